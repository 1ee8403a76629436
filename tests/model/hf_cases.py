"""What the reference scripts that build random HF models share (hf_reference.py,
hf_ssm_reference.py): read the cases, build each model seeded, perturb its parameters so
that every one matters, save it where the test reads it. Imported by those scripts in their
reference subprocess, so it needs nothing but torch.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# a family's own parameters: (whether a parameter's name is one, what it becomes given its
# value and a draw of unit noise)
Special = list[tuple[Callable[[str], bool], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]


def perturb(model: torch.nn.Module, gen: torch.Generator, special: Special) -> None:
    """Every parameter moved off its initial value: the family's `special` ones its way (the
    first rule whose name matches), the other vectors (biases, norms) to noise, the matrices
    to noise of unit-variance outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters appear once
            noise = torch.randn(p.shape, generator=gen)
            how = next((how for matches, how in special if matches(name)), None)
            if how is not None:
                p.copy_(how(p, noise))
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def build(
    case: dict, make: Callable[[], torch.nn.Module], special: Special
) -> tuple[torch.nn.Module, torch.Generator]:
    """The case's model, `make()`, in eval mode and perturbed, all seeded by the case; and
    the generator, to draw the case's inputs from next."""
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    model = make().eval()
    perturb(model, gen, special)
    return model, gen


def main(run_case: Callable[[Path, dict], None]) -> None:
    """`python SCRIPT OUT CASES_JSON`: `run_case(OUT, case)` for each case of the file."""
    out, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for case in cases:
        run_case(out, case)
    print(json.dumps({"cases": [c["name"] for c in cases]}))
