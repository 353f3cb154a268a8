"""Does infinifuse run models that no benchmark names, and give eager's outputs?

The vision suite (``benchmarks/vision.py``) times twelve timm models; users bring others. For
each model of ``--models`` (timm names, or ``tv:NAME`` for a torchvision model; the default
list spans convnets, mobile nets, hybrids and transformers outside the suite), in a process of
its own (a kernel fault ends that process alone), this builds it with random weights
(``pretrained=False``; BatchNorm statistics calibrated as ``vision.py`` does, so a wrong
kernel in a residual branch shows), fp16 (``--dtype``) on the GPU, at the model's own input
size, batch ``--batch``; ``hf:ConfigClass`` is a transformers base model outside the model
zoo, 2 small layers, fed 11 ids a row with the last row padded. It records:

- ``first_call_s``: the compiled model's first call (Dynamo, the backend, Triton's compiles);
- ``err`` and ``eager_err``: the largest ``|out - eager fp32|`` of the third call (a replay)
  and of eager fp16, and ``ok``: ``err <= 4 * eager_err + 1e-3 * scale`` (fp16's own noise
  with room for a different summation order);
- the modes every signature reached, the fallback reasons, the graphs Dynamo made and the
  fused groups and launches of their reports.

``benchmarks/ledger.py`` keeps per model ``outputs_ok`` and ``captured`` (1 or 0: every
signature replays a CUDA graph), ``first_call_s`` and the two errors.

``--cpu`` runs the transformers architectures (``HF_MODELS`` and ``HF_MORE``: timm cannot be
imported on the CPU machine) on the CPU under Triton's interpreter in fp32, for correctness
alone: eager fp32 is then the reference, so ``ok`` asks ``err <= 1e-3 * scale``.

No timing beyond the first call: ``--parallel`` processes share the GPUs and the host's CPUs
(per call against reduce-overhead is ``vision.py``'s job, one model at a time).

    python benchmarks/diag/diag_model_sweep.py --parallel 8 --out /tmp/sweep.json [--commit C]
    python benchmarks/diag/diag_model_sweep.py --models tv:shufflenet_v2_x1_0,dla34
    python benchmarks/diag/diag_model_sweep.py --cpu --parallel 2 --child-timeout 900
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Outside the vision suite: families with ops or layouts the suite lacks (channel shuffles,
# dense concatenations, grouped and dilated convs, attention hybrids, weight standardization,
# pooling token mixers, squeeze-excite variants, re-parameterized blocks).
MODELS = (
    "mobilenetv2_100,mnasnet_100,mixnet_s,tf_efficientnet_lite0,efficientnetv2_rw_t,"
    "mobilenetv4_conv_small,lcnet_050,rexnet_100,fbnetc_100,ghostnetv2_100,densenet121,"
    "dla34,hrnet_w18_small,res2net50_14w_8s,skresnet18,ecaresnet26t,resnest14d,seresnext26d_32x4d,"
    "cspresnet50,regnetx_002,regnetz_b16,dm_nfnet_f0,vgg11_bn,xception41,selecsls42b,"
    "convnextv2_atto,inception_next_tiny,poolformer_s12,caformer_s18,efficientformer_l1,"
    "fastvit_t8,mobileone_s0,repghostnet_050,mobilevit_xs,mobilevitv2_050,edgenext_xx_small,"
    "efficientvit_b0,coatnet_0_rw_224,maxvit_nano_rw_256,deit_tiny_patch16_224,"
    "eva02_tiny_patch14_224,pvt_v2_b0,cait_xxs24_224,resmlp_12_224,hgnetv2_b0,starnet_s1,"
    "tv:mobilenet_v2,tv:mobilenet_v3_small,tv:shufflenet_v2_x1_0,tv:squeezenet1_1,tv:googlenet,"
    "tv:densenet121,tv:efficientnet_v2_s,tv:regnet_y_400mf,tv:convnext_tiny,tv:swin_t,"
    "tv:maxvit_t,tv:resnet18"
)
# transformers architectures outside the model zoo (tests/model_zoo.py): ``hf:ConfigClass``,
# built from the config's defaults shrunk to 2 layers of width 128 (the names a config has
# of these), random weights, fed ids with a padded last row.
HF_MODELS = (
    "hf:MixtralConfig,hf:Qwen2MoeConfig,hf:Qwen3Config,hf:Qwen3MoeConfig,hf:Gemma3TextConfig,"
    "hf:OlmoConfig,hf:Olmo2Config,hf:CohereConfig,hf:Starcoder2Config,hf:GPTBigCodeConfig,"
    "hf:PhiConfig,hf:GraniteConfig,hf:MambaConfig,hf:ModernBertConfig,"
    "hf:DebertaV2Config,hf:RoFormerConfig,hf:MobileBertConfig,hf:ConvBertConfig,"
    "hf:CLIPTextConfig,hf:NomicBertConfig"
)
# More transformers architectures, run by ``--cpu`` (with HF_MODELS): recent decoders, MoE,
# hybrids of attention with Mamba / linear attention / convolutions, encoder-decoders, vision
# and audio encoders. On the CPU (transformers 5.24, 2026-11-30) all gave eager's outputs, and
# Bamba and Qwen3-Next found a bug of the copy folding (879954e). (Helium is left out: its
# attention's output projection assumes heads x head_dim = hidden, which small sizes break.)
HF_MORE = (
    "hf:GptOssConfig,hf:Glm4Config,hf:Glm4MoeConfig,hf:Cohere2Config,hf:OlmoeConfig,"
    "hf:SmolLM3Config,hf:Ernie4_5Config,hf:Exaone4Config,hf:HunYuanDenseV1Config,"
    "hf:SeedOssConfig,hf:MiniMaxConfig,hf:GraniteMoeConfig,hf:NemotronConfig,hf:ArceeConfig,"
    "hf:BitNetConfig,hf:MptConfig,hf:PersimmonConfig,hf:Qwen3NextConfig,"
    "hf:JambaConfig,hf:FalconH1Config,hf:BambaConfig,hf:Lfm2Config,hf:RecurrentGemmaConfig,"
    "hf:FalconMambaConfig,hf:T5Config,hf:MT5Config,hf:BartConfig,hf:PegasusConfig,"
    "hf:MarianConfig,hf:EsmConfig,hf:DebertaConfig,hf:SqueezeBertConfig,hf:BigBirdConfig,"
    "hf:ErnieConfig,hf:ViTConfig,hf:DeiTConfig,hf:BeitConfig,hf:Dinov2Config,"
    "hf:SiglipVisionConfig,hf:CLIPVisionConfig,hf:Wav2Vec2Config,hf:HubertConfig"
)
_HF_SIZES = {"hidden_size": 128, "n_embd": 128, "num_hidden_layers": 2, "n_layer": 2,
             "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2,
             "intermediate_size": 256, "moe_intermediate_size": 64, "vocab_size": 1000,
             "num_local_experts": 4, "num_experts": 4,
             "embedding_size": 128, "state_size": 8, "num_experts_per_tok": 2,
             "global_attn_every_n_layers": 2, "pad_token_id": 0,
             # encoder-decoders (T5, BART), vision encoders (32 x 32 images, 8 x 8 patches)
             "d_model": 128, "d_ff": 256, "d_kv": 32, "num_layers": 2, "num_heads": 4,
             "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
             "decoder_attention_heads": 4, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256,
             "image_size": 32, "patch_size": 8}  # fmt: skip


def build(name: str, seed: int) -> tuple[Any, int]:
    """The model (eval mode, CPU, fp32) and its input size (0: a text model)."""
    import torch

    torch.manual_seed(seed)
    if name.startswith("hf:"):
        import transformers

        make = getattr(transformers, name[3:])
        defaults = make()  # (built again from the sizes: configs derive fields at init)
        sizes = {k: v for k, v in _HF_SIZES.items() if hasattr(defaults, k)}
        config = make(**sizes, use_cache=False)
        if getattr(config, "head_dim", 0) is None:  # (HunYuan: its attention reads it)
            config.head_dim = config.hidden_size // config.num_attention_heads
        return transformers.AutoModel.from_config(config).eval(), 0
    if name.startswith("tv:"):
        import torchvision

        model = torchvision.models.get_model(name[3:], weights=None)
        return model.eval(), 224
    import timm

    model = timm.create_model(name, pretrained=False)
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    return model.eval(), size


def _hf_inputs(model: Any, batch: int, gen: Any) -> dict[str, Any]:
    """A transformers model's inputs, by what its forward takes: images (the config's size),
    audio samples, or ids with a padded last row (the zoo's inputs), with decoder ids for an
    encoder-decoder."""
    import inspect

    import torch

    takes = inspect.signature(model.forward).parameters
    if "pixel_values" in takes and "input_ids" not in takes:
        size = model.config.image_size
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=gen)}
    if "input_values" in takes:
        return {"input_values": torch.randn(batch, 4000, generator=gen)}
    mask = torch.ones(max(batch, 2), 11, dtype=torch.long)
    mask[-1, -3:] = 0
    inputs = {"input_ids": torch.randint(2, 1000, mask.shape, generator=gen),
              "attention_mask": mask}  # fmt: skip
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(2, 1000, (mask.shape[0], 5), generator=gen)
    return inputs


def run_child(
    name: str, batch: int, seed: int, dtype_name: str = "float16", on_cpu: bool = False
) -> dict[str, Any]:
    import torch
    from vision import calibrate_norms, fusion_fields

    import fusebackend
    import fusebackend.report as fusebackend_report

    record: dict[str, Any] = {"model": name, "batch": batch}
    device = torch.device("cpu" if on_cpu else "cuda")
    model, size = build(name, seed)
    record["image_size"] = size
    model.to(device)
    gen = torch.Generator().manual_seed(seed)
    if size:
        calibrate_norms(model, size, device, seed)
        inputs = {"x": torch.randn(batch, 3, size, size, generator=gen)}
    else:
        inputs = _hf_inputs(model, batch, gen)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    def first(out: Any) -> Any:  # logits, a last hidden state
        out = out if isinstance(out, torch.Tensor) else out[0]
        return out.float()

    def sync() -> None:
        if not on_cpu:
            torch.cuda.synchronize()

    with torch.no_grad():
        inputs = {k: v.to(device) for k, v in inputs.items()}
        ref32 = first(model(**inputs))
        dtype = getattr(torch, dtype_name)
        model.to(dtype)
        model.train().eval()  # (LeViT-style caches of attention biases: vision.py says why)
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        eager = first(model(**inputs))
    before = fusebackend_report._recorded
    compiled = torch.compile(model, backend="infinifuse", dynamic=False)
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        compiled(**inputs)
        sync()
        record["first_call_s"] = round(time.perf_counter() - start, 3)
        for _ in range(2):
            out = first(compiled(**inputs))
    scale = ref32.abs().max().item()
    record["err"] = (out - ref32).abs().max().item()
    record["eager_err"] = (eager - ref32).abs().max().item()
    record["scale"] = scale
    record["ok"] = bool(record["err"] <= 4 * record["eager_err"] + 1e-3 * scale)
    record.update(fusion_fields(fusebackend_report._reports_since(before)))
    stats = fusebackend.stats()
    record["modes"] = sorted(set(stats["fusion_modes"].values()))
    record["fallback_reasons"] = sorted({str(v)[:300] for v in stats["fallback_reasons"].values()})
    return record


def run_one(name: str, args: argparse.Namespace, gpu: int) -> dict[str, Any]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    if args.cpu:  # (set before the child imports torch and Triton)
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--batch",
               str(args.batch), "--seed", str(args.seed),
               *(["--cpu"] if args.cpu else ["--dtype", args.dtype])]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.child_timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {args.child_timeout} s"}
    for line in done.stdout.splitlines():
        if line.startswith("SWEEP "):
            record = json.loads(line[6:])
            record["process_s"] = round(time.perf_counter() - start, 1)
            return record
    return {"model": name, "error": f"exit {done.returncode}", "stderr_tail": done.stderr[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        default=None,
        help="default: MODELS and HF_MODELS; with --cpu HF_MODELS and HF_MORE",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="on the CPU under Triton's interpreter, fp32 (correctness only)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=1, help="processes at once, spread "
                        "over the visible GPUs")  # fmt: skip
    parser.add_argument("--child-timeout", type=float, default=240)
    parser.add_argument("--time-budget", type=float, default=1e9,
                        help="start no model after this many seconds")  # fmt: skip
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu:
        args.dtype = "float32"
    if args.models is None:
        args.models = HF_MODELS + "," + HF_MORE if args.cpu else MODELS + "," + HF_MODELS
    if args.child:
        try:
            record = run_child(args.child, args.batch, args.seed, args.dtype, args.cpu)
        except Exception as exc:  # noqa: BLE001  (a build or compile failure: the record says)
            import traceback

            record = {"model": args.child, "error": f"{type(exc).__name__}: {exc}"[:600],
                      "traceback_tail": traceback.format_exc()[-2500:]}  # fmt: skip
        print("SWEEP " + json.dumps(record), flush=True)
        return 0
    import torch
    from ledger import environment  # (benchmarks/ledger.py: its rows_of reads this file)

    result: dict[str, Any] = {"benchmark": "diag_model_sweep", "environment": environment(),
                              "batch": args.batch, "dtype": args.dtype, "records": []}  # fmt: skip
    if args.commit:
        result["environment"]["commit"] = args.commit
    gpus = max(1, torch.cuda.device_count())
    names = [n for n in args.models.split(",") if n]
    start = time.perf_counter()
    records = result["records"]

    def job(index: int, name: str) -> dict[str, Any]:
        if time.perf_counter() - start > args.time_budget:
            return {"model": name, "error": "not started: time budget"}
        return run_one(name, args, index % gpus)

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for record in pool.map(job, range(len(names)), names):
            records.append(record)
            brief = {k: record.get(k) for k in ("model", "ok", "err", "eager_err", "modes",
                     "graphs", "fused_groups", "first_call_s", "error")}  # fmt: skip
            print(json.dumps(brief), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    bad = [r["model"] for r in records if not r.get("ok")]
    print(f"{len(records) - len(bad)} of {len(records)} ok; not ok: {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
