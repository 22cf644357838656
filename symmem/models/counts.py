"""A model given only by its counts: ``Nact`` activation values per sample, ``Psi`` parameters, an input image.

For questions asked in counts (a Q&A about CS231n estimates: "532,752 activations and 19,072,984
parameters") and for the ZeRO paper's model of Psi parameters.  The graph is an input image (B, C, Hi, Wi),
one tensor of ``Nact`` values per sample standing for every layer output (role ``activations``) and one
parameter tensor of ``Psi`` elements.

>>> from symmem import derive
>>> d = derive("counts", convention="cs231n", optimizer="adam", free=("Psi",))
>>> d.parameter_memory
16*Psi
"""

from __future__ import annotations

from ..errors import SymmemError
from ..graph import GraphBuilder, Model
from ..symbols import B, C, Hi, Psi, Wi
from ..symbols import Nact as Acts


def build_counts(name: str, activations: int = 532_752, parameters: int = 19_072_984,
                 input: tuple[int, int, int] = (1, 50, 180)) -> Model:
    g = GraphBuilder(name)
    x = g.input("image", (B, C, Hi, Wi))
    x = g.op("flatten", x, name="flatten", start_dim=1)
    # A tied, bias-free linear map stands for "the layers": it makes Nact values per sample and owns no weights.
    g.op("linear", x, name="activations", role="activations", out_features=Acts, bias=False, tied=True)
    g.parameter("parameters", (Psi,))
    if not isinstance(input, tuple | list) or len(input) != 3 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input):
        raise SymmemError(f"counts: input is (channels, height, width), three positive integers, got {input!r}")
    c, hh, ww = input
    defaults = {B: 128, C: c, Hi: hh, Wi: ww, Acts: activations, Psi: parameters}
    return Model(name, g.finish(), defaults, (B, Acts, Psi),
                 f"a model given by counts: {activations:,} activations per sample, {parameters:,} parameters",
                 options={"activations": activations, "parameters": parameters})

