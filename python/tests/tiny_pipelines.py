"""diffusers pipelines from tiny configs (those of diffusers' own pipeline tests), random
weights, with word-level tokenizers made here (no download): FLUX (CLIP and T5 text encoders)
and Wan (UMT5). bench/python/pipeline_bench.py imports it too, where pytest may be missing."""

import diffusers
import tokenizers
import torch
import transformers

WORDS = ["<pad>", "</s>", "<unk>", "a", "cat", "on", "the", "moon", "red", "dog", "runs"]
PROMPT = "a red cat on the moon"


def tokenizer(max_length):
    """A word-level fast tokenizer over WORDS, padding to max_length as the pipelines ask."""
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model,
                                                model_max_length=max_length, pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>")


def t5_config(layers):
    return transformers.T5Config(vocab_size=1000, d_model=32, d_ff=37, d_kv=8,
                                 num_layers=layers, num_heads=4)


def flux(seed=0, layers=3):
    """A FluxPipeline: CLIP (`layers` layers), T5 (`layers` blocks), a FLUX transformer with
    `layers` double and single blocks, a one-level VAE."""
    torch.manual_seed(seed)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37,
        layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=layers, pad_token_id=1,
        vocab_size=1000, hidden_act="gelu", projection_dim=32)).eval()
    t5 = transformers.T5EncoderModel(t5_config(layers)).eval()  # as from_pretrained leaves it
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=layers, num_single_layers=layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
        tokenizer=tokenizer(77), text_encoder_2=t5, tokenizer_2=tokenizer(512),
        transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_image(pipe, seed=0, steps=2):
    return pipe(prompt=PROMPT, height=8, width=8, num_inference_steps=steps,
                guidance_scale=3.5, max_sequence_length=16,
                generator=torch.Generator().manual_seed(seed), output_type="pt").images


def wan(seed=0, layers=3):
    """A WanPipeline: UMT5 (`layers` blocks), a Wan transformer of `layers` blocks, Wan's VAE."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                     num_res_blocks=1, temperal_downsample=[False, True, True])
    text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=1000, d_model=32, d_ff=37, d_kv=8, num_layers=layers, num_heads=4)).eval()
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    pipe = diffusers.WanPipeline(
        tokenizer=tokenizer(512), text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan_video(pipe, seed=0, steps=2):
    return pipe(prompt=PROMPT, negative_prompt="a dog", height=16, width=16, num_frames=9,
                num_inference_steps=steps, guidance_scale=6.0, max_sequence_length=16,
                generator=torch.Generator().manual_seed(seed), output_type="pt").frames
