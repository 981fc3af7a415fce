"""`hrm plan`'s text for a model small enough that every buffer is under 1 MB: the GPU's parts
are listed (it said "nothing" beside 570 kB used) and the job's time reads in ms, not hours."""

from __future__ import annotations

import json


def test_a_tiny_models_plan_lists_its_parts_and_times_the_job_in_person_units(
    run_cli, tmp_path, mixtral_with_tokenizer
):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [1, 2]}\n')
    status, out, err = run_cli("plan", "--model", mixtral_with_tokenizer, "--hardware", "l4",
                               "--prompts", prompts, "--gen-len", "4",
                               "--policy", "N=2,mu=2,attn=gpu,ffn=gpu,w=1,kv=1")  # fmt: skip
    assert status == 0, err
    gpu = next(line for line in out.splitlines() if "GPU memory" in line)
    assert "resident weights" in gpu and not gpu.rstrip().endswith("nothing")
    job = next(line for line in out.splitlines() if line.startswith("job:"))
    assert " h at " not in job and "e-" not in job
    assert job.split(" in ")[1].split(" at ")[0].endswith(("ms", " s"))
    status, out, _ = run_cli("plan", "--model", mixtral_with_tokenizer, "--hardware", "l4",
                             "--prompts", prompts, "--gen-len", "4", "--json")  # fmt: skip
    assert status == 0 and json.loads(out)["job"]["hours"] > 0  # the JSON keeps its hours
