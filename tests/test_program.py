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
        ("prefect_jax.nonexistent_module:program", "cannot import module 'prefect_jax.nonexistent_module'"),
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
