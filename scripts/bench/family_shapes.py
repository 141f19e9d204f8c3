"""The tiny random checkpoints' configs of each family, as mlx-lm's own classes read them (the
shapes of the parity tests' checkpoints): scripts/bench/family_speed.py builds them, and
compare_mlx_lm.py and family_identity.py take their `--tiny` shapes from here."""

_QWEN3_5_TEXT = dict(vocab_size=512, hidden_size=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                     num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                     full_attention_interval=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                      "mrope_section": [3, 3, 2], "mrope_interleaved": True})
# family -> the multimodal config.json mlx-lm reads (its text_config: tests/hf_checkpoints.py's shapes)
TINY = {
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_text",
                                                          "intermediate_size": 128}},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}},
    # the Mamba-2 hybrids: tests/hf_checkpoints.py's hybrid_hf_config shapes, in mlx-lm's spelling
    # (time_step_limit as numbers, Granite's legacy layer names); vocabulary 512 as above
    "nemotron_h": {"model_type": "nemotron_h", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                   "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2,
                   "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "hybrid_override_pattern": "ME*M-E", "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "moe_intermediate_size": 64,
                   "moe_shared_expert_intermediate_size": 64, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                   "time_step_min": 0.001, "time_step_limit": [0.001, float("inf")], "tie_word_embeddings": False},
    "granitemoehybrid": {"model_type": "granitemoehybrid", "vocab_size": 512, "hidden_size": 64,
                         "intermediate_size": 64, "num_hidden_layers": 4, "max_position_embeddings": 4096,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
                         "embedding_multiplier": 4.0, "attention_multiplier": 0.0625, "logits_scaling": 2.0,
                         "residual_multiplier": 0.5, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                         "rms_norm_eps": 1e-6, "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 64, "mamba_n_heads": 4, "mamba_d_head": 32,
                         "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "position_embedding_type": "nope", "tie_word_embeddings": True,
                         "time_step_limit": [0.0, float("inf")]},
    # GLM-4.x MoE: tests/hf_checkpoints.py's glm_hf_config shapes (a dense layer, two MoE layers of
    # 8 experts top-2 in 2 groups plus a shared expert, q/k norm, q/k/v biases, half-rotary heads of 32)
    "glm4_moe": {"model_type": "glm4_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "moe_intermediate_size": 64,
                 "num_experts_per_tok": 2, "n_shared_experts": 1, "n_routed_experts": 8,
                 "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
                 "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
                 "num_nextn_predict_layers": 0},
    # tests/gpt_oss_checkpoints.py's shapes: sliding window 8 and full layers alternating, sinks,
    # YaRN (truncated: mlx-lm's reading), 4 biased experts top-2; vocabulary 512 as above
    "gpt_oss": {"model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 8,
                "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "layer_types": ["sliding_attention", "full_attention"] * 2, "tie_word_embeddings": False,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 128, "truncate": True}},
    # tests/deepseek_checkpoints.py's shapes: 3 layers (1 dense), MLA with a q LoRA, 8 experts in 2
    # groups top-2 plus a shared expert
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                    "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32,
                    "v_head_dim": 32, "qk_nope_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                    "moe_layer_freq": 1, "first_k_dense_replace": 1, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
                    "tie_word_embeddings": False},
    # tests/deepseek_checkpoints.py's Kimi-Linear shapes (KDA, MLA, KDA, KDA; the first MLP dense)
    # in the published spelling mlx-lm reads
    "kimi_linear": {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128, "head_dim": 32,
                    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "model_max_length": 4096,
                    "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "num_heads": 2,
                                           "head_dim": 32, "short_conv_kernel_size": 4},
                    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
                    "moe_intermediate_size": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                    "qk_rope_head_dim": 32, "v_head_dim": 32, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 1, "num_expert_group": 2, "topk_group": 1,
                    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "tie_word_embeddings": False},
}
