"""Applications built on derivations: the largest batch under a budget (:mod:`.budget`), the generated LaTeX
paper (:mod:`.article`) and memory from counts alone, CS231n's rule (:mod:`.from_counts`)."""
