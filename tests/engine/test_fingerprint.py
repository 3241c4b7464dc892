"""Fingerprints: equal for bitwise-equal parameters, different after the smallest change."""
from __future__ import annotations

import numpy as np
import torch

from ddp_helpers.engine.model import build_model, fingerprint
from ddp_helpers.engine.telemetry import samples_hash


def test_equal_parameters_equal_fingerprints_whatever_the_container():
    a, b = build_model(0), build_model(0)
    fa = fingerprint(list(a.parameters()))
    assert fa == fingerprint(list(b.parameters()))
    assert fa == fingerprint([p.detach().numpy() for p in a.parameters()])  # the worker's NumPy views
    assert -2**63 <= fa < 2**63  # fits the int64 telemetry column


def test_one_ulp_anywhere_changes_the_fingerprint():
    model = build_model(0)
    before = fingerprint(list(model.parameters()))
    seen = {before}
    for p, i in ((model[1].weight, (9, 783)), (model[1].weight, (0, 0)), (model[1].bias, (4,))):
        with torch.no_grad():
            old = p[i].clone()
            p[i] = torch.nextafter(old, old + 1)  # the smallest float32 step
            seen.add(fingerprint(list(model.parameters())))
            p[i] = old
    assert len(seen) == 4  # every one-ULP change gave a new value
    assert fingerprint(list(model.parameters())) == before  # and restoring restores it


def test_fingerprint_depends_on_order_and_on_every_tensor():
    w, b = [p.detach().clone() for p in build_model(0).parameters()]
    assert fingerprint([w, b]) != fingerprint([b, w])
    assert fingerprint([w, b]) != fingerprint([w])


def test_samples_hash_tells_apart_other_samples_and_other_orders():
    idx = np.arange(64)
    h = samples_hash(idx)
    assert h == samples_hash(torch.arange(64))
    assert h != samples_hash(idx[::-1].copy())
    assert h != samples_hash(np.arange(1, 65))


def _cells(fig):
    """(green/red matrix, cell texts by row) of plot_fingerprints' top panel."""
    ax = fig.axes[0]
    texts = [(round(t.get_position()[1]), t.get_text()) for t in ax.texts]
    rows = [[txt for row, txt in texts if row == k] for k in range(len(ax.get_yticks()))]
    return np.asarray(ax.images[0].get_array()), rows


def test_fingerprint_figure_shows_equal_columns_green_and_a_differing_rank_red(small_run):
    import copy

    from ddp_helpers import plot_fingerprints

    same, rows = _cells(plot_fingerprints(small_run, max_steps=5))
    assert same.shape == (2, 5) and same.all()
    assert rows[0] == rows[1] == [f[:6] for f in small_run.ranks[0].param_fingerprint[:5]]
    assert len(set(rows[0])) == 5  # a new value after every step
    broken = copy.deepcopy(small_run)
    broken.ranks[1].param_fingerprint[3] = "0" * 16  # rank 1 drifted at step 3
    same, rows = _cells(plot_fingerprints(broken, max_steps=5))
    assert same[1].tolist() == [1, 1, 1, 0, 1] and same[0].all() and rows[1][3] == "000000"
    differing = plot_fingerprints(broken).axes[1].lines[0].get_ydata()
    assert list(differing) == [0, 0, 0, 1] + [0] * (broken.n_steps - 4)
