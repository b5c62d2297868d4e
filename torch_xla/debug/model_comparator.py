"""Compare a model's intermediate tensors between two runs (e.g. CPU against XLA).

Put `save(name, tensor)` calls in the model's forward; run it once per folder set with
`configure(folder)` (or `MODELCMP_SAVEDIR`); `compare(folder1, folder2)` reports the
tensors whose values differ. Without a folder, `save` does nothing. As a script:
`python -m torch_xla.debug.model_comparator FOLDER1 FOLDER2` (exit status 1 on differences).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from typing import Dict, List, Optional

import torch


class _Saves:
    """Where `save` writes: `dir` (None: `MODELCMP_SAVEDIR`), `ids` (name -> saves so far
    in the current folder), `step` (the step of that folder). Read and written by the
    threads that call `configure` / `save`, without a lock."""
    __slots__ = ("dir", "ids", "step")

    def __init__(self):
        self.reset(None)

    def reset(self, save_dir: Optional[str], step: Optional[int] = None) -> None:
        self.dir = save_dir
        self.ids: Dict[str, int] = {}
        self.step = step


_saves = _Saves()
_SAVED = re.compile(r".*\.\d+$")


def _save_dir() -> Optional[str]:
    if _saves.dir is not None:
        return _saves.dir
    from .._engine import env_vars
    return env_vars.get("MODELCMP_SAVEDIR")


def _is_master() -> bool:
    from ..core import xla_model as xm
    return xm.is_master_ordinal()


def _default_name() -> str:
    """`file.lLINE` of the caller of `save`."""
    here = os.path.basename(__file__)
    for frame in reversed(traceback.extract_stack(limit=8)[:-1]):
        if os.path.basename(frame.filename) != here:
            return f"{os.path.basename(frame.filename)}.l{frame.lineno}"
    return "noname"


def configure(save_dir: Optional[str]) -> None:
    """Saves go to `save_dir` from now on (None: back to `MODELCMP_SAVEDIR`); ids restart."""
    _saves.reset(save_dir)


def save(name: Optional[str], tensor: torch.Tensor, step: Optional[int] = None) -> torch.Tensor:
    """Saves a CPU copy of `tensor` as `NAME.ID` (ID counts saves of one name; under
    `step-STEP/` when `step` is given) and returns `tensor`. No-op without a folder."""
    folder = _save_dir()
    if folder is None:
        return tensor
    data = tensor.detach().cpu()
    if not _is_master():
        return tensor
    name = name if name is not None else _default_name()
    path = folder
    if step is not None:
        path = os.path.join(folder, f"step-{step}")
        os.makedirs(path, exist_ok=True)
        if step != _saves.step:
            _saves.reset(_saves.dir, step)
    ids = _saves.ids
    n = ids.get(name, 0)
    ids[name] = n + 1
    torch.save(data, os.path.join(path, f"{name}.{n}"))
    return tensor


def _index_of(sizes: List[int], flat: int) -> List[int]:
    index = []
    for size in reversed(sizes):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def compare_tensors(tensor1: torch.Tensor, tensor2: torch.Tensor, rtol: float = 1e-05, atol: float = 1e-08,
                    max_diffs: int = 25) -> str:
    """A report of the elements where |a - b| > max(rtol * max(|a|, |b|), atol) ('' if none)."""
    sizes = list(tensor1.size())
    if sizes != list(tensor2.size()):
        return f"Tensors have different shape: {sizes} vs. {list(tensor2.size())}\n"
    a = tensor1.flatten().tolist()
    b = tensor2.flatten().tolist()
    diffs = []
    for i, (v1, v2) in enumerate(zip(a, b)):
        err = abs(v1 - v2)
        if err > max(max(abs(v1), abs(v2)) * rtol, atol):
            diffs.append((err, i, v1, v2))
    diffs.sort(key=lambda d: d[0], reverse=True)
    report = "".join(f"{_index_of(sizes, i)}: {v1} vs. {v2}\terror={err}\n" for err, i, v1, v2 in diffs[:max_diffs])
    if len(diffs) > max_diffs:
        report += f"... aborting after {max_diffs} differences\n"
    return report


def _saved(folder: str) -> set:
    out = set()
    for root, _, names in os.walk(folder):
        rel = os.path.relpath(root, folder)
        out.update(os.path.normpath(os.path.join(rel, n)) for n in names if _SAVED.match(n))
    return out


def tensor_file_compare(path1: str, path2: str, rtol: float = 1e-05, atol: float = 1e-08,
                        max_diffs: int = 25) -> str:
    report = compare_tensors(torch.load(path1), torch.load(path2), rtol=rtol, atol=atol, max_diffs=max_diffs)
    if not report:
        return ""
    name, n = re.match(r"(.*)\.(\d+)$", os.path.basename(path1)).groups()
    m = re.match(r"step-(\d+)$", os.path.basename(os.path.dirname(path1)))
    head = f'Changes in saved tensor "{name}" with id={n}' + (f" at step={m.group(1)}" if m else "") + "\n"
    return head + "".join(f"  {line}\n" for line in report.split("\n"))


def compare(save_dir1: str, save_dir2: str, rtol: float = 1e-05, atol: float = 1e-08, max_diffs: int = 25) -> str:
    """A report of the tensors saved in one folder and not the other, or with other values."""
    files1, files2 = _saved(save_dir1), _saved(save_dir2)
    report = ""
    for f in sorted(files1):
        if f not in files2:
            report += f"Mismatch: {f} not in {save_dir2}\n"
        else:
            report += tensor_file_compare(os.path.join(save_dir1, f), os.path.join(save_dir2, f), rtol=rtol,
                                          atol=atol, max_diffs=max_diffs)
    for f in sorted(files2 - files1):
        report += f"Mismatch: {f} not in {save_dir1}\n"
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtol", type=float, default=1e-05)
    parser.add_argument("--atol", type=float, default=1e-08)
    parser.add_argument("--max_diffs", type=int, default=25)
    parser.add_argument("savedir1", metavar="SAVEDIR1")
    parser.add_argument("savedir2", metavar="SAVEDIR2")
    args = parser.parse_args(argv)
    report = compare(args.savedir1, args.savedir2, rtol=args.rtol, atol=args.atol, max_diffs=args.max_diffs)
    if report:
        print(report, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
