"""``python -m jaxattn.convert --from-hf PATH --out CHECKPOINT [--dtype bfloat16] [--mtp-depth N]``.

Reads a transformers ``save_pretrained`` directory (config.json + safetensors or
pytorch_model.bin), converts it (refusing configs it does not fully understand) and writes the
orbax checkpoint that ``jaxattn.convert.load_checkpoint`` reads.  The checkpoint's
multi-token-prediction modules (DeepSeek-V3, Qwen3-Next) come along; ``--mtp-depth N`` keeps the
first ``N`` of them (0: none).
"""

from __future__ import annotations

import argparse
import sys

from jaxattn.convert.checkpoint import save_checkpoint
from jaxattn.convert.hf import dtype_names, load_hf


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxattn.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--from-hf", required=True, metavar="PATH",
                      help="a transformers save_pretrained directory")
  parser.add_argument("--out", required=True, metavar="CHECKPOINT",
                      help="directory to write (config.json + orbax state); must not exist")
  parser.add_argument("--dtype", default="float32", choices=dtype_names(),
                      help="parameter storage and compute dtype (default float32)")
  parser.add_argument("--mtp-depth", type=int, default=None, metavar="N",
                      help="keep the first N multi-token-prediction modules (0 drops them; "
                      "default: all the checkpoint holds)")
  args = parser.parse_args(argv)
  extra = {} if args.mtp_depth is None else {"mtp_depth": args.mtp_depth}
  model = load_hf(args.from_hf, dtype=args.dtype, **extra)
  save_checkpoint(model, args.out)
  cfg = model.config
  print(f"wrote {args.out}: {cfg.num_layers} layers, pattern {cfg.layer_pattern!r}, "
        f"{cfg.num_experts} experts, {cfg.mtp_depth} MTP modules, param_dtype "
        f"{cfg.param_dtype}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
