"""What stops an on-policy attacker (issue 50): the defended attackers of antidistill (`defences`), each an
on-policy student of the plain teacher at τ 1 (λ 0) whose scores reach its loss through a defence
(`opd.teachers.defended`), run at the control point (temperature-lam0-tau1) beside its control opd-plain
of the same seed; and what each defence costs an honest user of the scores, measured on the same teacher
and prompts.

    if is_control(point): ...                                      # where the defended attackers run
    costs = serving_costs(cfg.defences, teacher, ads, rows, ...)   # {label: {kl, top1, positions}}

The honest user's cost is measured at every completion position of the first `COST_TRACES` traces of the
control point (the teacher's own answers at τ 1): KL(teacher || what a client reads from the served
scores) in nats and the share of positions where the served scores' most likely token is the teacher's
(`defended.honest_cost`); the same for the ADS distribution at each λ of the sweep (`findings.ads_label`), the
reference defence, which changes what the teacher samples too (its accuracy is the ADS point's). The
teacher's own answers are unchanged by a score-only defence.
"""

from __future__ import annotations

import torch

from opdkit.data import labels
from opdkit.jobs.antidistill.findings import CONTROL_TEMPERATURE
from opdkit.opd.teachers.defended import Defence, distribution_cost, honest_cost

DEFENDED_DIR = "defended"  # defended/<defence>-seed<seed>/: a defended attacker's trainer output and result
COST_TRACES = 128  # traces of the control point the honest user's cost is measured on


def is_control(point) -> bool:
    """The point the defended attackers run at: the plain teacher (λ 0) at τ 1, their control's."""
    return point.lam == 0 and point.temperature == CONTROL_TEMPERATURE


def folder_name(spec: str, seed: int) -> str:
    return f"{spec.replace(':', '')}-seed{seed}"


@torch.no_grad()
def serving_costs(
    defences: list[str],
    teacher: torch.nn.Module,
    ads: dict[str, torch.nn.Module],
    rows: list[dict],
    pad_token_id: int,
    vocab: int,
    device: torch.device,
    seed: int,
    batch_size: int = 64,
) -> dict[str, dict]:
    """Per defence (and per ADS teacher of `ads`, by label): the mean over the completion positions of
    `rows` (`sft.student.sft_rows`' input_ids and labels) of KL(teacher || served) and the top-1 agreement,
    and the positions counted; sampled gives None for both (it sends no distribution). The noise of noise:S
    is drawn from a generator seeded by `seed`."""
    sums = {label: [0.0, 0.0] for label in [*defences, *ads]}
    generator, count = torch.Generator(device).manual_seed(seed), 0
    for batch in labels.make_batches(rows, list(range(len(rows))), batch_size, pad_token_id, device):
        ids_BT, attn_BT = batch["input_ids"], batch["attention_mask"]
        target_BT = labels.shifted_labels(batch["labels"])
        at_BT = target_BT != labels.IGNORE
        logits_NV = teacher(input_ids=ids_BT, attention_mask=attn_BT).logits[at_BT][:, :vocab].float()
        actual_N = target_BT[at_BT]
        count += int(at_BT.sum())
        found = {spec: honest_cost(Defence.of(spec), logits_NV, actual_N, generator) for spec in defences}
        for label, model in ads.items():
            ads_NV = model(input_ids=ids_BT, attention_mask=attn_BT).logits[at_BT][:, :vocab]
            found[label] = distribution_cost(logits_NV, torch.log_softmax(ads_NV.float(), -1))
        for label, cost in found.items():
            if cost is not None:
                sums[label][0] += float(cost["kl_N"].sum())
                sums[label][1] += float(cost["top1_N"].sum())
    out = {}
    for label, (kl, top1) in sums.items():
        sent = label in ads or Defence.of(label).kind != "sampled"
        out[label] = {
            "kl": kl / count if sent and count else None,
            "top1": top1 / count if sent and count else None,
            "positions": count,
        }
    return out
