"""Rules the planner and the executor must apply identically: which weights are resident
(placement), which path each CPU GEMM takes (cpu_gemm, gemm_paths), and how freed host memory is
kept for reuse (host_memory). Each is one definition both sides call."""
