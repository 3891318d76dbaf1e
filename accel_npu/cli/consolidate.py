"""``accel-npu consolidate CKPT_DIR OUT_DIR``: a sharded ZeRO-2/3 checkpoint (e.g. the directory
``accelerator.save_state`` wrote) -> one diffusers-style directory per trained component
(``OUT_DIR/transformer/config.json`` + safetensors shards + index), loadable with
``from_pretrained``. Built on ``deepspeed.utils.zero_to_fp32``; streams one shard at a time."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "consolidate", help="turn a sharded DeepSpeed checkpoint into from_pretrained directories",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory (holds `latest` and the tag folder)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp32", "fp16"],
                   help="floating-point dtype of the written weights (default: fp32, the master weights)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in `latest`)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from accel_npu.checkpointing import consolidate

    written = consolidate(args.ckpt_dir, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                          tag=args.tag, progress=not args.no_progress)
    for name, files in written.items():
        print(f"{args.out_dir}/{'' if name == '.' else name + '/'}: {len(files)} file(s): {', '.join(files)}")
    return 0
