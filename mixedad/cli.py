"""Command line: ``python -m mixedad demo``."""
import argparse

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m mixedad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="mixed_grad vs double backward on a deep random generator")
    demo.add_argument("--model", choices=["mlp", "dcgan"], default="mlp")
    demo.add_argument("--depth", type=int, default=64,
                      help="Linear layers (mlp) or extra conv blocks per stage (dcgan)")
    demo.add_argument("--width", type=int, default=512, help="hidden width (mlp) or latent size (dcgan)")
    demo.add_argument("--batch", type=int, default=256)
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from mixedad.demo import run_demo

        for name in ("depth", "width", "batch", "repeats"):
            if getattr(args, name) < 1:
                raise SystemExit(f"python -m mixedad demo: --{name} must be >= 1, got {getattr(args, name)}.")
        run_demo(model=args.model, depth=args.depth, width=args.width, batch=args.batch,
                 dtype=DTYPES[args.dtype], device=args.device, repeats=args.repeats)
    return 0
