import torch

from fp8rl.algos import masked_mean, masked_quantiles, metrics_to_floats


def test_masked_mean_ignores_masked_nan_and_handles_empty():
    values = torch.tensor([[1.0, float("nan"), 3.0]])
    mask = torch.tensor([[True, False, True]])
    assert masked_mean(values, mask).item() == 2.0
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_quantiles_single_and_interpolated():
    values = torch.tensor([4.0, 1.0, 3.0, 2.0, 100.0])
    mask = torch.tensor([True, True, True, True, False])
    torch.testing.assert_close(masked_quantiles(values, mask, [0.0, 0.5, 1.0]), torch.tensor([1.0, 2.5, 4.0]))
    single = masked_quantiles(values, torch.tensor([False, False, True, False, False]), [0.01, 0.99])
    torch.testing.assert_close(single, torch.tensor([3.0, 3.0]))


def test_metrics_to_floats_keeps_order_and_converts_numbers():
    metrics = {"b": torch.tensor(1.5), "a": 2, "c": torch.tensor(0.25, dtype=torch.float64)}
    floats = metrics_to_floats(metrics)
    assert list(floats) == ["b", "a", "c"]
    assert floats == {"b": 1.5, "a": 2.0, "c": 0.25}
    assert all(type(v) is float for v in floats.values())


def test_sort_and_partition_quantile_paths_agree():
    from fp8rl.algos.masked import _quantiles_by_partition, _quantiles_by_sort

    generator = torch.Generator().manual_seed(0)
    levels = [0.0, 0.01, 0.05, 0.5, 0.95, 0.99, 1.0]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        values = torch.randn(37, 11, generator=generator).to(dtype)
        mask = torch.rand(37, 11, generator=generator) < 0.3
        by_sort = _quantiles_by_sort(values, mask, levels, 1.0)
        by_partition = _quantiles_by_partition(values, mask, levels, 1.0)
        assert by_sort.dtype == by_partition.dtype == dtype
        torch.testing.assert_close(by_sort, by_partition)
        torch.testing.assert_close(
            by_partition.float(),
            torch.quantile(values[mask].float(), torch.tensor(levels)),
            atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
            rtol=0,
        )
        empty = torch.zeros_like(mask)
        assert torch.equal(
            _quantiles_by_sort(values, empty, levels, 1.0), _quantiles_by_partition(values, empty, levels, 1.0)
        )
