import numpy as np
import pytest

from prefect_jax.training.program import ProgramError, check_program, load_program


def test_loads_the_example_program():
    program = load_program("prefect_jax.examples.digits:program")
    assert callable(program.train_step)


@pytest.mark.parametrize(
    "path, match",
    [
        ("no_colon_here", "not of the form 'package.module:attribute'"),
        ("a:b:c", "not of the form"),
        (
            "prefect_jax.nonexistent_module:program",
            "cannot import module 'prefect_jax.nonexistent_module'",
        ),
        ("prefect_jax.examples.digits:nope", "has no attribute 'nope'"),
    ],
)
def test_bad_paths_say_what_is_wrong(path, match):
    with pytest.raises(ProgramError, match=match):
        load_program(path)


def test_missing_methods_are_listed():
    class Half:
        def init(self, rng):
            return {}

        def train_step(self, state, batch):
            return state, {}

    with pytest.raises(ProgramError, match="missing eval_step, train_data, eval_data"):
        check_program(Half())


def test_digits_arrays_are_scikit_learns_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from prefect_jax.examples.digits import digits_arrays

    data, target = digits_arrays()
    np.testing.assert_array_equal(data, load_digits().data)
    np.testing.assert_array_equal(target, load_digits().target)
    # The file is read without running scikit-learn's (slow) import.
    code = (
        "import sys; from prefect_jax.examples.digits import digits_arrays; digits_arrays(); "
        "print('sklearn' in sys.modules)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_digits_batches_reshuffle_each_epoch_and_cover_it_once():
    from prefect_jax.examples.digits import _ShuffledBatches

    n, batch = 250, 32  # 7 batches an epoch, 26 examples dropped
    ids = np.arange(n)[:, None]  # each example is its own index
    source = _ShuffledBatches(ids, ids[:, 0], batch, seed=3)

    def epoch(e):
        return np.concatenate([source[i]["y"] for i in range(e * 7, (e + 1) * 7)])

    first, second = epoch(0), epoch(1)
    assert len(first) == len(set(first)) == 7 * batch  # no example twice within an epoch
    assert not np.array_equal(first, second)  # reshuffled each epoch
    np.testing.assert_array_equal(source[9]["x"][:, 0], source[9]["y"])  # x and y stay paired
    # The same seed gives the same stream, in any access order (what a restored iterator relies on).
    np.testing.assert_array_equal(
        _ShuffledBatches(ids, ids[:, 0], batch, seed=3)[9]["y"], source[9]["y"]
    )
    assert not np.array_equal(
        _ShuffledBatches(ids, ids[:, 0], batch, seed=4)[9]["y"], source[9]["y"]
    )
