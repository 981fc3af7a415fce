import json
import math
import re

import pytest

from hrm.arch import BUNDLED_DIR, ModelArch, bundled_model_names, resolve_model
from hrm.errors import HrmError

# Published total parameter counts.
PUBLISHED = {"mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9, "dbrx": 132e9}


@pytest.mark.parametrize("name, published", sorted(PUBLISHED.items()))
def test_totals_match_published_sizes_within_one_percent(name, published):
    arch = resolve_model(name)
    assert abs(arch.total_params - published) / published < 0.01
    assert arch.weight_bytes("bfloat16") == 2 * arch.total_params


def test_mixtral_8x7b_hand_count():
    arch = resolve_model("mixtral-8x7b")
    h, i, v = 4096, 14336, 32000
    attention = h * (4096 + 2 * 1024) + 4096 * h
    layer = attention + 8 * 3 * h * i + h * 8 + 2 * h
    assert arch.layer_params == layer
    assert arch.total_params == 32 * layer + 2 * v * h + h
    # about 12.9B active parameters per token (2 of 8 experts)
    assert arch.active_params == pytest.approx(12.9e9, rel=0.01)
    assert arch.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2


def test_dbrx_fields():
    arch = resolve_model("dbrx")
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size) == (40, 6144, 10752)
    assert (arch.num_experts, arch.experts_per_token) == (16, 4)
    assert arch.rope_theta == 500000 and arch.clip_qkv == 8
    assert arch.norm == "layernorm" and not arch.renormalize_top_k


def test_bundled_names():
    assert set(PUBLISHED) <= set(bundled_model_names())


def _config(**changes):
    config = json.loads(
        (resolve_model.__globals__["BUNDLED_DIR"] / "mixtral-8x7b.json").read_text()
    )
    config.update(changes)
    return config


def test_rope_theta_from_transformers_5_rope_parameters():
    config = _config(rope_parameters={"rope_theta": 12345.0, "rope_type": "default"})
    del config["rope_theta"]
    assert ModelArch.from_hf_config(config).rope_theta == 12345.0


def test_qwen2_moe_and_olmoe_parse():
    qwen = ModelArch.from_hf_config(
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 24,
            "hidden_size": 2048,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "vocab_size": 151936,
        }
    )
    assert qwen.total_params == pytest.approx(14.3e9, rel=0.01)  # Qwen1.5-MoE-A2.7B
    olmoe = ModelArch.from_hf_config(
        {
            "model_type": "olmoe",
            "num_hidden_layers": 16,
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "vocab_size": 50304,
        }
    )
    assert olmoe.total_params == pytest.approx(6.9e9, rel=0.01)  # OLMoE-1B-7B


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("qwen3-235b-a22b", 235e9, 22e9),
        ("qwen2-57b-a14b", 57.4e9, 14e9),
        ("olmoe-1b-7b", 6.9e9, 1.3e9),
        # OpenAI's card (2025-08-05): 116.83B / 5.13B and 20.91B / 3.61B; its active count
        # leaves out the embedding (a lookup, 201088 x 2880), ours counts it
        ("gpt-oss-120b", 116.83e9, 5.13e9 + 201088 * 2880),
        ("gpt-oss-20b", 20.91e9, 3.61e9 + 201088 * 2880),
        # Z.ai's card: 106B / 12B, its active count without the embedding and LM head
        ("glm-4.5-air", 106e9, 12e9 + 2 * 151552 * 4096),
        # DeepSeek's cards: 15.7B / 2.4B (V2-Lite) and 671B / 37B (V3), the active counts
        # without the embedding; V3's weights README gives 36.6B active with its LM head
        ("deepseek-v2-lite", 15.7e9, 2.4e9 + 102400 * 2048),
        ("deepseek-v3", 671e9, 36.6e9 + 129280 * 7168),
    ],
)
def test_bundled_families_count_the_parameters_their_cards_publish(name, total, active):
    arch = resolve_model(name)
    assert arch.total_params == pytest.approx(total, rel=0.015)
    assert arch.active_params == pytest.approx(active, rel=0.03)


def test_glm_routes_in_groups_with_a_dense_first_layer_and_half_a_head_rotating():
    arch = resolve_model("glm-4.5-air")
    assert arch.routing == "sigmoid_groups" and arch.router_bias and not arch.shared_expert_gate
    assert arch.dense_layers == (0,) and arch.dense_intermediate_size == 10944
    assert arch.rotary_dim == 64 and arch.shared_expert_intermediate_size == 1408
    assert arch.layer_arch(0).shared_expert_intermediate_size == 0  # the dense layer's MLP only


def test_deepseek_caches_one_latent_row_a_token_several_times_smaller_than_k_and_v():
    """MLA's point: V2-Lite caches 512 + 64 values a token and layer, where its 16 heads' keys
    (128 + 64) and values (128) would be 5120; V3's 128 heads would be 40960."""
    lite, v3 = resolve_model("deepseek-v2-lite"), resolve_model("deepseek-v3")
    for arch, heads in ((lite, 16), (v3, 128)):
        assert (arch.num_key_value_heads, arch.head_dim, arch.value_dim) == (1, 576, 512)
        assert arch.kv_token_bytes("bfloat16") == 576 * 2
        assert heads * (192 + 128) / 576 == pytest.approx(arch.num_attention_heads * 320 / 576)
    assert lite.kv_token_bytes("int8") == 576 + 9 * 4  # codes, and a scale and minimum a group
    assert lite.routing == "softmax_groups" and lite.n_group == 1 and lite.q_lora_rank == 0
    assert v3.routing == "sigmoid_groups" and (v3.n_group, v3.topk_group) == (8, 4)
    assert v3.dense_layers == (0, 1, 2) and v3.q_lora_rank == 1536
    # YaRN's mscale at mscale_all_dim, squared, scales the softmax (1 + 0.1 ln 40 at V3's 1.0)
    assert v3.softmax_scale == pytest.approx(192**-0.5 * (1 + 0.1 * math.log(40)) ** 2)
    assert v3.geometry()["kv_lora_rank"] == 512


def test_gpt_oss_slides_every_other_layer_and_reads_no_more_than_its_window():
    arch = resolve_model("gpt-oss-120b")
    assert arch.sliding_layers == tuple(range(0, 36, 2)) and arch.sliding_window == 128
    assert arch.window(0) == 128 and arch.window(1) is None
    assert arch.mean_keys(100) == 100  # within the window every layer reads every key
    assert arch.mean_keys(4096) == (4096 + 128) / 2
    assert dict(arch.rope_scaling)["factor"] == 32.0 and arch.routing == "topk_softmax"
    assert arch.geometry()["sliding_layers"] == list(range(0, 36, 2))


def test_each_family_says_what_its_layers_add():
    qwen3, qwen2, olmoe = (resolve_model(n) for n in ("qwen3-30b-a3b", "qwen2-57b-a14b",
                                                        "olmoe-1b-7b"))  # fmt: skip
    # Qwen3-MoE: 32 heads of 128 at hidden 2048, q/k norms per head, top-8 renormalised
    assert (qwen3.head_dim, qwen3.q_size, qwen3.qk_norm) == (128, 4096, "head")
    assert qwen3.qk_norm_params == 256 and qwen3.renormalize_top_k
    assert not qwen3.attention_bias and qwen3.shared_expert_params == 0
    # Qwen2-MoE: q/k/v biases, a gated shared expert of 20480, top-8 not renormalised
    assert qwen2.attention_bias and not qwen2.renormalize_top_k and qwen2.qk_norm is None
    assert qwen2.shared_expert_params == 3 * 3584 * 20480 + 3584
    # OLMoE: q/k norms over the whole projection
    assert olmoe.qk_norm == "projection" and olmoe.qk_norm_params == 2 * 2048
    assert all(a.round_router_weights for a in (qwen3, qwen2, olmoe))
    assert not resolve_model("mixtral-8x7b").round_router_weights


@pytest.mark.parametrize(
    ("changes", "dense"),
    [
        ({"mlp_only_layers": [0, 5]}, (0, 5)),
        ({"decoder_sparse_step": 2}, tuple(range(0, 48, 2))),  # sparse where (i + 1) % 2 == 0
        ({"decoder_sparse_step": 3, "mlp_only_layers": [2, 4]}, (0, 1, 2, 3, 4, 6, 7, 9)),
        ({"mlp_only_layers": [], "decoder_sparse_step": 1}, ()),
    ],
)
def test_qwen_dense_layers_are_the_ones_transformers_makes_dense(changes, dense):
    config = json.loads((BUNDLED_DIR / "qwen3-30b-a3b.json").read_text()) | changes
    arch = ModelArch.from_hf_config(config, where="c.json")
    assert arch.dense_layers[: len(dense)] == dense
    if len(dense) < 8:
        assert arch.dense_layers == dense
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    theirs = Qwen3MoeConfig(**{**config, "num_hidden_layers": 10, "hidden_size": 64,
                               "num_experts": 2, "moe_intermediate_size": 8,
                               "intermediate_size": 16, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "head_dim": 32})  # fmt: skip
    made = [type(Qwen3MoeDecoderLayer(theirs, i).mlp).__name__.endswith("MLP") for i in range(10)]
    assert tuple(i for i in range(10) if made[i]) == tuple(i for i in dense if i < 10)


def test_a_dense_layer_is_one_expert_every_token_takes():
    config = json.loads((BUNDLED_DIR / "qwen2-57b-a14b.json").read_text())
    sparse = ModelArch.from_hf_config(config)
    mixed = ModelArch.from_hf_config(config | {"mlp_only_layers": [0, 3]})
    (kind, n), (dense, m) = mixed.layer_kinds()
    assert (n, m) == (26, 2) and kind.layer_params == sparse.layer_params
    assert (dense.num_experts, dense.experts_per_token, dense.intermediate_size) == (1, 1, 18944)
    assert dense.router_params == 0 and dense.shared_expert_params == 0
    # the two dense layers hold their MLP instead of the router, 64 experts and shared expert
    mlp = 3 * 3584 * 18944
    assert sparse.total_params - mixed.total_params == 2 * (
        sparse.layer_params - mlp - 2 * 3584 - sparse.attention_params
    )
    assert mixed.first_layers(3).dense_layers == (0,)
    assert mixed.layer_arch(3) == dense and mixed.layer_arch(1) == kind
    # a plan records them, so that it is not run on the model without them
    assert mixed.geometry()["dense_layers"] == [0, 3] and "dense_layers" not in sparse.geometry()


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"mlp_only_layers": list(range(48))}, "make every layer dense"),
        ({"decoder_sparse_step": 100}, "make every layer dense"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
        ({"mlp_only_layers": "0,5"}, "mlp_only_layers must be a list of layer indices"),
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
    ],
)
def test_what_the_qwen_families_cannot_run_is_refused_by_name(changes, fragment):
    config = json.loads((BUNDLED_DIR / "qwen3-30b-a3b.json").read_text()) | changes
    with pytest.raises(HrmError, match=re.escape(fragment)):
        ModelArch.from_hf_config(config, where="c.json")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"hidden_size": -4096}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_layers"),
        ({"num_local_experts": 1, "num_experts_per_tok": 2}, "exceeds"),
        ({"num_key_value_heads": 5}, "not a multiple"),
        ({"vocab_size": "big"}, "vocab_size"),
    ],
)
def test_bad_configs(changes, fragment):
    with pytest.raises(HrmError) as exc:
        ModelArch.from_hf_config(_config(**changes))
    assert fragment in str(exc.value)


def test_missing_field_is_named():
    config = _config()
    del config["num_local_experts"]
    with pytest.raises(HrmError, match="missing field 'num_local_experts'"):
        ModelArch.from_hf_config(config)


def test_resolve_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    assert resolve_model(tmp_path).total_params == resolve_model("mixtral-8x7b").total_params
    assert resolve_model(tmp_path / "config.json").name == tmp_path.name
    with pytest.raises(HrmError, match="unknown model 'gpt-5'"):
        resolve_model("gpt-5")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HrmError, match="no config.json"):
        resolve_model(empty)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(HrmError, match="malformed JSON"):
        resolve_model(tmp_path / "broken.json")


@pytest.mark.parametrize(
    ("bundled", "changes", "fragment"),
    [
        ("gpt-oss-20b", {"layer_types": ["full_attention"] * 3}, "layer_types must list one of"),
        ("gpt-oss-20b", {"layer_types": ["local"] * 24}, "layer_types must list one of"),
        ("gpt-oss-20b", {"sliding_window": None}, "sliding_window"),
        ("gpt-oss-20b", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
         "rope_type 'dynamic' is not supported; supported: default, yarn"),
        ("gpt-oss-20b", {"rope_scaling": {"rope_type": "yarn"}},
         "yarn needs factor and original_max_position_embeddings"),
        ("glm-4.5-air", {"first_k_dense_replace": 46}, "first_k_dense_replace must be 0..45"),
        ("glm-4.5-air", {"n_group": 3}, "the groups must divide the experts"),
        ("glm-4.5-air", {"n_group": 4, "topk_group": 5}, "topk_group be 1..n_group"),
        ("glm-4.5-air", {"n_group": 32, "topk_group": 1}, "8 experts per token from 1 groups of 4"),
        ("deepseek-v2-lite", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supp"),
        ("deepseek-v2-lite", {"attention_bias": True}, "attention_bias true is not supported"),
        ("deepseek-v3", {"kv_lora_rank": 0}, "kv_lora_rank: must be a positive integer, got 0"),
        ("deepseek-v3", {"n_group": 3}, "the groups must divide the experts"),
    ],
)  # fmt: skip
def test_what_the_newer_families_configs_cannot_run_is_refused_by_name(bundled, changes, fragment):
    config = json.loads((BUNDLED_DIR / f"{bundled}.json").read_text()) | changes
    config.pop("rope_parameters", None)
    with pytest.raises(HrmError, match=re.escape(fragment)):
        ModelArch.from_hf_config(config, where="c.json")


def test_a_bad_family_config_is_one_line_and_exit_2(run_cli, tmp_path):
    from tests.conftest import assert_one_line_error

    config = json.loads((BUNDLED_DIR / "glm-4.5-air.json").read_text()) | {"n_group": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    status, out, err = run_cli("plan", "--model", tmp_path, "--hardware", "l4")
    assert_one_line_error(status, err, "config.json", "the groups must divide the experts")
    assert out == ""
