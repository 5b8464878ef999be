"""The torch engine's KV workspace (reuse, growth, release) and FP8 KV scales (hand-derived calibration)."""

import pytest
import torch

from ais_lightning.rollout.kv_cache import FP8KVScales, KVWorkspace

E4M3_MAX = 448.0


def test_workspace_views_are_reused_grown_and_released():
    ws = KVWorkspace(num_layers=3)
    k, v = ws.caches((2, 4, 5, 8), torch.float32, torch.device("cpu"))  # [B, Hkv, T, D]
    assert len(k) == len(v) == 3 and all(c.shape == (2, 4, 5, 8) for c in k + v)
    buffer = ws.buffer
    assert buffer.numel() == 2 * 3 * 2 * 4 * 5 * 8
    ptrs = {c.data_ptr() for c in k + v}
    assert len(ptrs) == 6  # six disjoint caches
    buffer.zero_()  # torch.empty: its old contents are arbitrary
    k[1].fill_(1.0)
    assert int((buffer == 1.0).sum()) == 2 * 4 * 5 * 8  # a view: writes land in the one buffer
    k2, _ = ws.caches((1, 4, 5, 8), torch.float32, torch.device("cpu"))  # smaller: same memory
    assert ws.buffer is buffer and k2[0].data_ptr() == buffer.data_ptr()
    ws.caches((4, 4, 5, 8), torch.float32, torch.device("cpu"))  # larger: a new buffer
    assert ws.buffer is not buffer and ws.buffer.numel() == 2 * 3 * 4 * 4 * 5 * 8
    ws.caches((1, 4, 5, 8), torch.bfloat16, torch.device("cpu"))  # another dtype: a new buffer
    assert ws.buffer.dtype == torch.bfloat16
    ws.release()
    assert ws.buffer is None
    with pytest.raises(ValueError, match="num_layers"):
        KVWorkspace(0)


def test_fp8_scales_calibrate_on_valid_positions_then_stay_fixed():
    scales = FP8KVScales()
    k = torch.zeros(2, 2, 3, 4)  # [B, Hkv, T, D]
    k[0, 0, 1, 2] = 8.96  # head 0 amax over valid positions
    k[1, 1, 0, 0] = -4.48  # head 1
    k[1, 0, 2, 1] = 1000.0  # a padding position: ignored by the calibration
    v = torch.ones(2, 2, 3, 4) * 0.5
    valid = torch.tensor([[True, True, True], [True, True, False]])  # [B, T]
    qk, qv = scales.store(0, k, v, valid)
    ((k_scale, v_scale),) = scales.scales
    torch.testing.assert_close(k_scale, torch.tensor([8.96, 4.48]) / E4M3_MAX)
    torch.testing.assert_close(v_scale, torch.tensor([0.5, 0.5]) / E4M3_MAX)
    assert qk[0, 0, 1, 2] == pytest.approx(8.96) and qk[1, 1, 0, 0] == pytest.approx(-4.48)  # amax is exact
    assert qk[1, 0, 2, 1] == pytest.approx(8.96)  # beyond the calibrated amax: saturates at 448 * scale
    torch.testing.assert_close(qv, v)
    # Decode steps (valid=None) reuse the scales: a larger value now saturates instead of recalibrating.
    step_k = torch.full((2, 2, 1, 4), 100.0)
    out_k, _ = scales.store(0, step_k, torch.zeros_like(step_k), None)
    torch.testing.assert_close(out_k[:, 0], torch.full((2, 1, 4), 8.96))
    torch.testing.assert_close(out_k[:, 1], torch.full((2, 1, 4), 4.48))
    with pytest.raises(RuntimeError, match="calibrated by a prefill"):
        scales.store(1, step_k, step_k, None)  # layer 1 was never calibrated
    scales.reset()
    assert scales.scales is None
    with pytest.raises(RuntimeError, match="calibrated by a prefill"):
        scales.store(0, step_k, step_k, None)
