"""Fingerprints: equal for bitwise-equal parameters, different after the smallest change."""
from __future__ import annotations

import numpy as np
import torch

from ddp_helpers.model import build_model, fingerprint
from ddp_helpers.telemetry import samples_hash


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
