"""`python -m torch_xla.distributed.fsdp.consolidate_sharded_ckpts --ckpt_prefix P
[--ckpt_suffix S] [--save_path F]`: consolidates sharded FSDP checkpoints."""
from __future__ import annotations

import argparse
from typing import List, Optional

from .state_dict_utils import consolidate_sharded_model_checkpoints


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ckpt_prefix", type=str, required=True, help="the path prefix of the sharded checkpoints")
    ap.add_argument("--ckpt_suffix", type=str, default="*.pth", help="their suffix (a glob pattern)")
    ap.add_argument("--save_path", type=str, default="", help="default: <ckpt_prefix>_consolidated.pth")
    a = ap.parse_args(argv)
    _, path = consolidate_sharded_model_checkpoints(a.ckpt_prefix, a.ckpt_suffix, a.save_path)
    print(f"consolidated checkpoint saved to {path}")


if __name__ == "__main__":
    main()
