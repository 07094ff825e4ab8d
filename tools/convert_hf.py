"""Convert between HF checkpoints and Megatron dist checkpoints, at any TP / PP / EP (docs/bridge.md, docs/moe.md).

    torchrun --nproc_per_node 4 tools/convert_hf.py to-mcore --hf-dir HF --out CKPT --tp 2 --pp 2
    torchrun --nproc_per_node 2 tools/convert_hf.py to-mcore --hf-dir MOE_HF --out CKPT --ep 2
    torchrun --nproc_per_node 1 tools/convert_hf.py to-hf --ckpt CKPT --out HF2 [--hf-dir HF] [--dtype bf16]

The number of processes must be a multiple of tp x pp (and of tp x ep x pp with --ep). Outputs are written
atomically; an existing output is refused unless --overwrite, and so is an output another conversion is writing
(an OS file lock, OUT.lock beside it). A truncated or corrupt safetensors file, or a shard the index lists that is
not there, is named before anything is written. Errors of this kind print one line per rank and exit with 2.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    for name, help_ in (("to-mcore", "HF folder -> Megatron dist checkpoint"),
                        ("to-hf", "Megatron dist checkpoint -> HF folder")):
        p = sub.add_parser(name, help=help_)
        if name == "to-mcore":
            p.add_argument("--hf-dir", required=True, help="HF folder: config.json, safetensors, tokenizer")
            p.add_argument("--allow-extra", action="store_true",
                           help="warn instead of failing on HF tensors the architecture map does not use")
        else:
            p.add_argument("--ckpt", required=True, help="Megatron dist checkpoint folder")
            p.add_argument("--hf-dir", default=None,
                           help="HF folder to take config and tokenizer from (default: CKPT/hf)")
            p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
        p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to run the conversion at")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to run the conversion at")
        p.add_argument("--ep", type=int, default=1,
                       help="expert-parallel size to run the conversion at (mixture-of-experts models)")
        p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                       help="dtype of the written weights (default: that of the input)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mcore_rl.bridge.convert import hf_to_mcore, mcore_to_hf
    from mcore_rl.procs import OutputLockedError

    common = dict(tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype, overwrite=args.overwrite,
                  progress=not args.no_progress)
    try:
        if args.direction == "to-mcore":
            hf_to_mcore(args.hf_dir, args.out, strict=not args.allow_extra, **common)
        else:
            mcore_to_hf(args.ckpt, args.out, hf_dir=args.hf_dir, max_shard_size=args.max_shard_size, **common)
    except (ValueError, FileExistsError, FileNotFoundError, OutputLockedError) as err:  # user errors: one line
        print(f"convert_hf.py {args.direction}: error [rank {os.environ.get('RANK', '0')}]: {err}", file=sys.stderr)
        return 2
    finally:
        from mcore_rl.parallel import destroy

        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
