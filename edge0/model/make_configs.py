"""The configs make-model writes: the three presets of Edge0's own families, two real models' shapes on qwen3_moe,
and a tiny config of every other mlx-lm MoE family, learned from that family's own ModelArgs.

A family's tiny config is the shared tiny values below (under every name the families use for them)
plus the family's own fields, keeping only the fields its mlx-lm ModelArgs declares; mlx-lm builds the
model from it as it would from a real checkpoint's config.json. Experts are 8 of 64 wide, K 2, so a
staged bank (2K slots) holds half of them.
"""

from __future__ import annotations

import dataclasses
import importlib

from ..errors import Edge0Error
from .arch import FAMILIES
from .tokenizer import VOCAB_SIZE, special_token_ids

BESPOKE = ("qwen3_moe", "qwen3_5_moe", "bailing_moe")
ARCHS = BESPOKE + tuple(sorted(FAMILIES, key=str.lower))
PRESETS = ("tiny", "small", "paper-35b", "olmoe-1b-7b", "qwen3-30b-a3b")
REAL_PRESETS = ("olmoe-1b-7b", "qwen3-30b-a3b")  # a real model's shapes on qwen3_moe (its I/O without its weights)
FORMATS = ("mlx", "hf")
LINEAR_STD = 0.02  # weights are uniform with this std: int8 draws are 10x faster than normal ones

# Shape class per preset, shared by the archs; _ARCH_DIMS overrides per arch.
_DIMS = {
    "tiny": dict(
        hidden_size=128, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    ),
    "small": dict(
        hidden_size=1024, num_hidden_layers=16, num_experts=64, num_experts_per_tok=4,
        moe_intermediate_size=512, intermediate_size=2816,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
    ),
    "paper-35b": dict(
        hidden_size=2048, num_hidden_layers=40, num_experts=256, num_experts_per_tok=4,
        moe_intermediate_size=512, intermediate_size=5120,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    ),
    # OLMoE-1B-7B-0924: full multi-head attention (16 heads of 128); the vocabulary stays Edge0's small one.
    "olmoe-1b-7b": dict(
        hidden_size=2048, num_hidden_layers=16, num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=1024, intermediate_size=1024,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    ),
    # Qwen3-30B-A3B, but for its vocabulary.
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    ),
}
# The real models' other fields that differ from the shared qwen3_moe config.
_REAL_FIELDS = {
    "olmoe-1b-7b": dict(norm_topk_prob=False, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "qwen3-30b-a3b": dict(),
}
_ARCH_DIMS = {
    ("qwen3_5_moe", "tiny"): dict(
        head_dim=64, full_attention_interval=2, shared_expert_intermediate_size=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    ),
    ("qwen3_5_moe", "small"): dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, full_attention_interval=4,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
    ),
    # Qwen3.5/3.6-35B-A3B text config, except K (real: 8 routed) and the vocabulary.
    ("qwen3_5_moe", "paper-35b"): dict(
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    ),
    ("bailing_moe", "tiny"): dict(n_group=4, topk_group=2),
    ("bailing_moe", "small"): dict(n_group=8, topk_group=4),
    ("bailing_moe", "paper-35b"): dict(num_attention_heads=16, n_group=8, topk_group=4),
}


def model_config(arch: str, preset: str) -> dict:
    """The Hugging Face style config.json (no quantization entry) of an arch at a preset."""
    check(arch, preset, "mlx")
    if arch not in BESPOKE:
        return family_config(arch)
    d = {**_DIMS[preset], **_ARCH_DIMS.get((arch, preset), {})}
    eos = special_token_ids()["<|im_end|>"]
    common = dict(
        hidden_act="silu", hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        num_experts=d["num_experts"], num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=True,
        rms_norm_eps=1e-6, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
        initializer_range=LINEAR_STD, eos_token_id=eos, use_cache=True,
    )
    if arch == "qwen3_moe":
        return {**dict(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **common,
            attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[],
            head_dim=d["head_dim"], intermediate_size=d["intermediate_size"],
            max_position_embeddings=40960, rope_theta=1000000.0,
            router_aux_loss_coef=0.001, output_router_logits=False,
            sliding_window=None, use_sliding_window=False, torch_dtype="bfloat16",
        ), **_REAL_FIELDS.get(preset, {})}
    if arch == "qwen3_5_moe":
        n, every = d["num_hidden_layers"], d["full_attention_interval"]
        text = dict(
            model_type="qwen3_5_moe_text", **common,
            attention_bias=False, attention_dropout=0.0, attn_output_gate=True, dtype="bfloat16",
            full_attention_interval=every, head_dim=d["head_dim"],
            layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
            linear_conv_kernel_dim=4,
            **{k: d[k] for k in ("linear_key_head_dim", "linear_num_key_heads",
                                 "linear_num_value_heads", "linear_value_head_dim")},
            max_position_embeddings=262144, mtp_num_hidden_layers=0,
            shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
            router_aux_loss_coef=0.001,
            rope_parameters=dict(
                mrope_interleaved=True, mrope_section=[11, 11, 10], partial_rotary_factor=0.25,
                rope_theta=10000000, rope_type="default",
            ),
        )
        return dict(
            architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
            text_config=text, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=eos,
        )
    return dict(
        architectures=["BailingMoeForCausalLM"], model_type="bailing_moe", **common,
        head_dim=d["hidden_size"] // d["num_attention_heads"], intermediate_size=d["intermediate_size"],
        max_position_embeddings=32768, rope_theta=600000.0, partial_rotary_factor=0.5,
        first_k_dense_replace=1, num_shared_experts=1, use_bias=False, use_qkv_bias=False,
        use_qk_norm=True, norm_head=False, norm_softmax=False,
        score_function="sigmoid", n_group=d["n_group"], topk_group=d["topk_group"],
        moe_router_enable_expert_bias=True, routed_scaling_factor=2.5,
        output_router_logits=False, torch_dtype="bfloat16",
    )


def check(arch: str, preset: str, fmt: str) -> None:
    if arch not in ARCHS:
        raise Edge0Error(f"Unknown arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    if preset not in PRESETS:
        raise Edge0Error(f"Unknown preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    if fmt not in FORMATS:
        raise Edge0Error(f"Unknown format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if arch not in BESPOKE and preset != "tiny":
        raise Edge0Error(f"Preset {preset!r} is made for {', '.join(BESPOKE)}; arch {arch} comes in preset tiny.")
    if preset in REAL_PRESETS and arch != "qwen3_moe":
        raise Edge0Error(f"Preset {preset!r} is a real model's shapes on arch qwen3_moe; give --arch qwen3_moe.")


def family_config(arch: str) -> dict:
    """The tiny config.json of an mlx-lm family (its module name), from its ModelArgs' fields; a multimodal
    wrapper's language model is its text_config, from its text model's args."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    values = {**_COMMON, **_FAMILY.get(arch, {})}
    eos = {"eos_token_id": special_token_ids()["<|im_end|>"], "torch_dtype": "bfloat16"}
    text_args = _TEXT_ARGS.get(arch) or getattr(module, "TextArgs", None)
    if text_args is not None:
        if isinstance(text_args, str):
            text_args = importlib.import_module(f"mlx_lm.models.{text_args}").ModelArgs
        outer = {k: v for k, v in _fields_of(module.ModelArgs, values).items() if k != "text_config"}
        return {"model_type": arch, **outer, "text_config": {"model_type": arch, **_fields_of(text_args, values)},
                **eos}
    return {"model_type": arch, **_fields_of(module.ModelArgs, values), **eos}


def _fields_of(args, values: dict) -> dict:
    fields = {f.name for f in dataclasses.fields(args)}
    return {k: v for k, v in values.items() if k in fields}


# Wrappers whose text model is another module's.
_TEXT_ARGS = {"qwen3_vl_moe": "qwen3_moe", "kimi_k25": "deepseek_v3", "gemma4": "gemma4_text"}


# Tiny values under every name the families give them.
_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rms_norm_eps=1e-6, norm_eps=1e-6, layer_norm_epsilon=1e-6, layernorm_epsilon=1e-6,
    max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
    num_experts=8, n_routed_experts=8, num_local_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, moe_topk=2, moe_k=2, moe_top_k=2, num_experts_per_token=2,
    norm_topk_prob=True, n_shared_experts=1, num_shared_experts=1, num_shared_expert=1,
    shared_expert_intermediate_size=64, first_k_dense_replace=1, decoder_sparse_step=1, mlp_only_layers=[],
    n_group=2, topk_group=1, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
    attention_bias=False, use_bias=False, rope_scaling=None, hidden_act="silu",
)
_LT = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_GEMMA4 = dict(enable_moe_block=True, top_k_experts=2, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
               vocab_size_per_layer_input=1024, sliding_window_pattern=2, global_head_dim=32,
               num_global_key_value_heads=2)
_GRANITE = dict(logits_scaling=1.0, attention_multiplier=0.03, embedding_multiplier=12.0, residual_multiplier=0.22)

# Each family's own fields.
_FAMILY = dict(
    afmoe=dict(layer_types=_LT, num_dense_layers=1, sliding_window=64, mup_enabled=True, n_group=1, topk_group=1),
    bailing_moe_linear=dict(layer_group_size=2, group_norm_size=1, moe_router_enable_expert_bias=True,
                            score_function="sigmoid"),
    deepseek_v2=dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, q_lora_rank=None,
                     rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096}),
    deepseek_v32=dict(index_head_dim=32, index_n_heads=2, index_topk=8, q_lora_rank=64),
    exaone_moe=dict(sliding_window=64, layer_types=_LT, is_moe_layer=[False, True, True, True]),
    gemma4=_GEMMA4,
    gemma4_text=_GEMMA4,
    glm4_moe=dict(use_qk_norm=True, partial_rotary_factor=0.5),
    glm_moe_dsa=dict(index_head_dim=32, index_n_heads=2, index_topk=8, moe_layer_freq=1, q_lora_rank=64,
                     rope_parameters={"rope_theta": 10000.0, "type": "default"}, topk_method="noaux_tc"),
    granitemoe=_GRANITE,
    granitemoehybrid=dict(**_GRANITE, layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=8,
                          mamba_n_heads=4, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                          mamba_expand=2, shared_intermediate_size=64),
    hunyuan=dict(use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False, cla_share_factor=2,
                 rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    jamba=dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
               num_hidden_layers=6, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2),
    kimi_linear=dict(linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                         "head_dim": 32, "short_conv_kernel_size": 4},
                     model_max_length=4096, num_experts_per_token=2, num_expert_group=2, topk_group=1,
                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32),
    lfm2_moe=dict(use_expert_bias=True, num_dense_layers=1, conv_bias=False, conv_L_cache=3,
                  layer_types=["conv", "full_attention", "conv", "full_attention"]),
    llama4=dict(attention_chunk_size=64, interleave_moe_layer_step=1, intermediate_size_mlp=256,
                num_experts_per_tok=1, use_qk_norm=True),
    longcat_flash=dict(attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=256,
                       expert_ffn_hidden_size=64, zero_expert_num=2, q_lora_rank=64, mla_scale_q_lora=True,
                       mla_scale_kv_lora=True, num_layers=2),
    mellum=dict(sliding_window=64, layer_types=_LT, rope_parameters={"full_attention": {"rope_theta": 10000.0},
                                                                     "sliding_attention": {"rope_theta": 10000.0}}),
    mimo_v2_flash=dict(hybrid_layer_pattern=[0, 1, 1, 0], moe_layer_freq=[0, 1, 1, 1],
                       add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, sliding_window_size=64,
                       swa_rope_theta=10000.0, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                       swa_head_dim=32, swa_v_head_dim=32, v_head_dim=32, partial_rotary_factor=0.5),
    minimax=dict(shared_intermediate_size=0, rotary_dim=16),
    mistral4=dict(q_lora_rank=64, rope_parameters={"rope_theta": 10000.0, "type": "yarn", "factor": 1.0,
                                                   "original_max_position_embeddings": 4096,
                                                   "llama_4_scaling_beta": 0.1}),
    nemotron_h=dict(mamba_num_heads=4, mamba_head_dim=32, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4,
                    n_groups=1, mlp_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "E", "*", "E"],
                    moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1),
    phixtral=dict(num_vocab=1024, model_dim=128, num_heads=4, num_layers=4, rotary_dim=16),
    qwen3_next=dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, full_attention_interval=2),
    solar_open=dict(partial_rotary_factor=1.0),
    step3p5=dict(num_attention_groups=2, moe_num_experts=8, moe_top_k=2, share_expert_dim=64, layer_types=_LT,
                 sliding_window=64, moe_layers_enum="1,2,3", swiglu_limits=[0, 7.0, 0, 7.0]),
)
