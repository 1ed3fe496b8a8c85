"""Antidistillation sampling: `gradient` (the proxy's mean completion gradient), `gradfile` (that gradient
as a file, checked on load), `direction` (Δ: finite difference or JVP along it), `sampler` (the teacher
sampled with λ·Δ, and coupled with plain sampling), `teacher` (the teacher serving the ADS logits for
scoring, for an on-policy attacker)."""
