"""Decoding: beam and greedy search over cached decoder states (:mod:`search`), the
translator that loads a checkpoint and turns text into text (:mod:`translation`), decoding
in worker processes (:mod:`workers`) and attention pictures (:mod:`attention_svg`)."""
