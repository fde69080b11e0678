"""Ray Data: a bundle mapped over a dataset on a local Ray instance (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import cuda_runner
from cuda_runner.errors import InputError
from cuda_runner.ray import BundlePredictor, map_bundle

ray = pytest.importorskip("ray")


def test_batches_larger_than_the_bound_are_split(compiled):
    bundle = compiled("linear", "cpu").path
    predictor = BundlePredictor(bundle)
    assert predictor.max_rows == 64
    x = np.random.default_rng(0).standard_normal((150, 16), dtype=np.float32)
    columns = predictor({"input": x})
    with cuda_runner.load(bundle) as model:
        np.testing.assert_allclose(columns["output_0"], model.run([x[:64]])["output_0"].tolist() + model.run([x[64:128]])["output_0"].tolist()
                                   + model.run([x[128:]])["output_0"].tolist(), rtol=1e-6)
    with pytest.raises(InputError, match="no column"):
        predictor({"other": x})


@pytest.mark.heavy
def test_map_bundle_on_a_local_ray(compiled):
    """Every output row is the model's output for its own input row: Ray is told
    to keep row order (its public DataContext setting), so row i of the result
    is matched to input row i, and each row is checked on its own."""
    from ray.data import DataContext

    bundle = compiled("linear", "cpu").path
    x = np.random.default_rng(1).standard_normal((300, 16), dtype=np.float32)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    context = DataContext.get_current()
    kept = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    try:
        dataset = ray.data.from_items([{"input": row} for row in x])
        rows = map_bundle(dataset, bundle, batch_size=100).take_all()
    finally:
        context.execution_options.preserve_order = kept
        ray.shutdown()
    assert len(rows) == len(x)
    with cuda_runner.load(bundle) as model:
        for index, row in enumerate(rows):
            expected = model.run([x[index:index + 1]])["output_0"][0]
            np.testing.assert_allclose(row["output_0"], expected, rtol=1e-5, atol=1e-6, err_msg=f"row {index}")
    # Rows differ from each other, so a shuffled result could not pass the check above.
    assert len({tuple(np.round(row["output_0"], 4)) for row in rows}) == len(rows)
