import re

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


def test_a_misspelt_attribute_is_refused_with_the_names_closest_to_it():
    with pytest.raises(ProgramError) as refused:
        load_program("prefect_jax.examples.bytelm:programm")
    said = str(refused.value)
    assert "has no attribute 'programm'; did you mean 'program'?" in said
    with pytest.raises(ProgramError) as refused:  # its own names, not the modules it imports
        load_program("prefect_jax.examples.digits:programm")
    said = str(refused.value)
    assert said.endswith("(names it defines: 'DigitsProgram', 'MLP', 'digits_arrays', "
                         "'load_digits_split', 'program', 'tiny')"), said  # fmt: skip
    with pytest.raises(ProgramError) as refused:  # a module of hundreds of names
        load_program("jax.numpy:arrray")
    said = str(refused.value)
    assert "did you mean 'array'" in said and re.search(r", \.\.\. \(\d+ more\)\)$", said)


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


# -- typed program params --------------------------------------------------------------


def test_a_factorys_typed_params_are_validated_and_build_the_program():
    from prefect_jax.training.program import load_program_with_params

    program, recorded = load_program_with_params(
        "programs:typed_digits", {"learning_rate": 0.01, "width": 16}, max_steps=300
    )
    assert program.params.learning_rate == 0.01 and program.hidden == (16, 16)
    # max_steps left None is the job's; recorded as filled, read_threads as exempt
    assert program.params.max_steps == 300
    assert recorded.values == {
        "learning_rate": 0.01,
        "width": 16,
        "max_steps": 300,
        "read_threads": 0,
    }
    assert recorded.filled == ("max_steps",) and recorded.exempt == ("read_threads",)
    assert recorded.compared() == {"learning_rate": 0.01, "width": 16}
    # given, max_steps is the program's own (and compared)
    again, recorded = load_program_with_params(
        "programs:typed_digits", {"max_steps": 50}, max_steps=300
    )
    assert again.params.max_steps == 50 and recorded.filled == ()
    # a dataclass works the same; no params: the type's defaults
    program = load_program("programs:dataclass_digits", {"width": "24"})
    assert program.params == __import__("programs").WidthParams(width=24)
    assert load_program("programs:dataclass_digits").hidden == (32, 32)


@pytest.mark.parametrize(
    "path, params, match",
    [
        (
            "programs:typed_digits",
            {"learning_rat": 0.1},
            r"learning_rat=0\.1 is not a field of DigitsParams \(did you mean 'learning_rate'\?\)"
            r".*learning_rate: float, width: int, max_steps: int \| None, read_threads: int",
        ),
        (
            "programs:typed_digits",
            {"width": "wide"},
            r"width='wide': Input should be a valid integer, unable to parse string as an "
            r"integer \(width takes int\)$",
        ),
        (
            "programs:dataclass_digits",
            {"dropout": [1]},
            r"dropout=\[1\]: Input should be a valid number \(dropout takes float\)$",
        ),
        (  # a boolean for a number: refused, not trained as 1 or 0
            "programs:typed_digits",
            {"width": True, "learning_rate": 0.1},
            r"refused: width=True: width takes int, not a boolean \(true and false are JSON "
            r"booleans, in --program-param as in a flow's program_params\); give a value of "
            r"that type$",
        ),
        (
            "programs:dataclass_digits",
            {"dropout": False},
            r"refused: dropout=False: dropout takes float, not a boolean",
        ),
        (  # a check of several fields: its own message, no "Value error, ", no whole dict
            "prefect_jax.examples.bytelm:program",
            {"preset": "tiny", "mesh": {"data": -1, "modle": 2}},
            r"refused: ByteLMParams: mesh=\{'data': -1, 'modle': 2\}: the byte LM places its "
            r"state on the axes 'data' .* not 'modle'",
        ),
        (
            "programs:typed_digits",
            ["width", 3],
            r"must be a dict of DigitsParams's fields, not \['width', 3\]",
        ),
    ],
)
def test_bad_params_name_the_key_and_value_and_list_the_fields(path, params, match):
    from prefect_jax.training.program_params import ProgramParamsError

    with pytest.raises(ProgramParamsError, match=match):
        load_program(path, params)


def test_a_boolean_nested_in_a_param_of_numbers_is_refused_not_trained_as_1():
    import dataclasses

    from prefect_jax.training.program_params import ProgramParamsError, validate_params

    @dataclasses.dataclass
    class Nested:
        hidden: tuple[int, ...] = (32,)
        mesh: dict[str, int] | None = None
        flags: dict[str, bool] | None = None

    with pytest.raises(
        ProgramParamsError,
        match=r"refused: hidden\[1\]=True: hidden takes tuple\[int, \.\.\.\]; "
        r"mesh\.data=False: mesh takes dict\[str, int\] \| None, which made a number of the "
        r"boolean; give a number there",
    ):
        validate_params(Nested, {"hidden": [32, True], "mesh": {"data": False}}, "p:program")
    # a boolean where the type takes one stays one
    instance, _ = validate_params(Nested, {"hidden": [8], "flags": {"fast": True}}, "p:program")
    assert instance == Nested(hidden=(8,), flags={"fast": True})


def test_params_given_to_a_program_that_takes_none_are_refused():
    with pytest.raises(ProgramError, match=r"program params \{'width': 3\} were given.*takes none"):
        load_program("prefect_jax.examples.digits:program", {"width": 3})
    assert load_program("prefect_jax.examples.digits:program", {}) is not None


def test_a_restore_compares_all_but_the_filled_and_exempt_params():
    from prefect_jax.training.program_params import (
        ProgramParams,
        ProgramParamsMismatchError,
        check_restore,
    )

    saved = ProgramParams(
        "P", {"lr": 0.1, "max_steps": 100, "threads": 2}, ("max_steps",), ("threads",)
    )
    meta = {"program_params": saved.as_meta()}
    same = ProgramParams(
        "P", {"lr": 0.1, "max_steps": 200, "threads": 8}, ("max_steps",), ("threads",)
    )
    check_restore(meta, same, "j", 20)  # more steps, other threads: the same computation
    check_restore({}, ProgramParams("P", {"lr": 9}), "j", 20)  # recorded none: not checked
    other = ProgramParams("P", {"lr": 0.2, "max_steps": 200, "threads": 2}, ("max_steps",))
    with pytest.raises(
        ProgramParamsMismatchError,
        match=r"job 'j' was trained to step 20 with other program params.*lr: saved 0\.1, "
        r"given 0\.2.*same params \(--program-param lr=0\.1; a flow's program_params "
        r"\{\"lr\": 0\.1\}\), or .* a new job name",
    ):
        check_restore(meta, other, "j", 20)


def test_a_restore_with_params_of_another_type_and_no_field_in_common_names_another_program():
    from prefect_jax.training.program_params import (
        ProgramParams,
        ProgramParamsMismatchError,
        check_restore,
    )

    meta = {"program_params": ProgramParams("mod:P", {"lr": 0.1}).as_meta()}
    with pytest.raises(ProgramParamsMismatchError) as refused:
        check_restore(meta, ProgramParams("other:Q", {"width": 3}), "j", 20)
    said = str(refused.value)
    assert said.startswith(
        "job 'j' was trained to step 20 by a program with program params mod:P (lr), and the "
        "program given takes program params other:Q (width): it is not the program"
    ), said
    none = {"program_params": ProgramParams().as_meta()}
    with pytest.raises(ProgramParamsMismatchError, match="by a program with no program params"):
        check_restore(none, ProgramParams("other:Q", {"width": 3}), "j", 20)
    # a field in common: the same program's params, told apart field by field (as before)
    with pytest.raises(ProgramParamsMismatchError, match=r"lr: saved 0\.1, given 0\.2"):
        check_restore(meta, ProgramParams("moved:P", {"lr": 0.2}), "j", 20)
    check_restore(meta, ProgramParams("moved:P", {"lr": 0.1}), "j", 20)  # a type moved: resumes


def test_a_field_added_to_the_params_type_since_a_step_resumes_it_at_its_default():
    """A program's params type grows a field (with a default) after a job saved steps: the old
    steps ran as that default says, so resuming them at the default is no mismatch; at any
    other value, or for a field without a default, the restore is refused and told why. The
    same for a field removed since, that the step saved at its default."""
    import dataclasses

    from pydantic import BaseModel, Field, field_serializer

    from prefect_jax.training.program_params import (
        ProgramParamsMismatchError,
        check_restore,
        validate_params,
    )

    class Before(BaseModel):
        lr: float = 0.1

    class After(BaseModel):
        lr: float = 0.1
        smoothing: float = 0.0
        schedule: list[int] = [1, 2]
        # recorded as its serializer writes it ("8x2"), its default compared the same way
        mesh: tuple[int, int] = (8, 2)

        @field_serializer("mesh")
        def _mesh_text(self, mesh: tuple[int, int]) -> str:
            return "x".join(map(str, mesh))

    class Required(BaseModel):
        lr: float = 0.1
        depth: int

    class Derived(BaseModel):  # a default made from another field's value: none of its own
        lr: float = 0.1
        warmup: float = Field(default_factory=lambda data: data["lr"] * 10)

    @dataclasses.dataclass
    class AfterDataclass:
        lr: float = 0.1
        tags: list[str] = dataclasses.field(default_factory=lambda: ["a"])

    def recorded(tp, given=None):
        return validate_params(tp, given, "p")[1]

    saved = {"program_params": recorded(Before).as_meta()}
    assert recorded(After).values["mesh"] == recorded(After).defaults["mesh"] == "8x2"
    check_restore(saved, recorded(After), "j", 20)
    with pytest.raises(ProgramParamsMismatchError, match=r"mesh: saved '<unset>', given '4x4'"):
        check_restore(saved, recorded(After, {"mesh": (4, 4)}), "j", 20)
    check_restore(saved, recorded(AfterDataclass), "j", 20)
    with pytest.raises(
        ProgramParamsMismatchError,
        match=r"smoothing: saved '<unset>', given 0\.2.*smoothing did not exist when step 20 was "
        r"saved: given its default, it counts as what that step ran with",
    ):
        check_restore(saved, recorded(After, {"smoothing": 0.2}), "j", 20)
    with pytest.raises(ProgramParamsMismatchError, match=r"depth: saved '<unset>', given 3"):
        check_restore(saved, recorded(Required, {"depth": 3}), "j", 20)
    # removed since: the same where the step saved it at its default
    check_restore({"program_params": recorded(After).as_meta()}, recorded(Before), "j", 20)
    with pytest.raises(ProgramParamsMismatchError, match=r"warmup: saved '<unset>', given 1\.0"):
        check_restore(saved, recorded(Derived), "j", 20)
    with pytest.raises(
        ProgramParamsMismatchError,
        match=r"smoothing: saved 0\.3, given '<unset>'\); nothing was restored or trained\. "
        r"Resume it with the same params, or .*smoothing is no longer a field of the params type",
    ):
        check_restore(
            {"program_params": recorded(After, {"smoothing": 0.3}).as_meta()},
            recorded(Before),
            "j",
            20,
        )


def test_a_refused_restore_suggests_the_params_its_run_was_given_not_all_they_decided():
    """A job trained with a preset, resumed without it: the refusal lists every field that
    differs, and suggests the params its run was given (the preset), not each field the preset
    decided, where those resume the same. Else (a step saved before the given fields were
    recorded, a preset changed since) every differing field. Never an exempt field; each as a
    shell takes it."""
    from typing import ClassVar

    from pydantic import BaseModel, model_validator

    from prefect_jax.training.program_params import (
        ProgramParamsMismatchError,
        check_restore,
        validate_params,
    )

    class Sized(BaseModel):
        preset: str = "small"
        width: int | None = None
        depth: int | None = None
        lr: float = 0.1
        mesh: dict | None = None  # where it runs, not what it computes
        note: str = ""

        restore_exempt: ClassVar[tuple[str, ...]] = ("mesh",)

        @model_validator(mode="after")
        def _from_preset(self):
            width, depth = {"small": (64, 4), "tiny": (8, 1)}[self.preset]
            self.width, self.depth = self.width or width, self.depth or depth
            return self

    def refusal(saved_given, given_now, edit=None):
        meta = validate_params(Sized, saved_given, "p")[1].as_meta()
        (edit or (lambda m: None))(meta)
        with pytest.raises(ProgramParamsMismatchError) as err:
            check_restore(
                {"program_params": meta}, validate_params(Sized, given_now, "p")[1], "j", 20
            )
        text = str(err.value)
        suggested = text.split("Resume it with the same params")[1].split(", or train")[0]
        return text, suggested.split("; a flow's program_params ")[0] + ")" * ("(" in suggested)

    text, suggested = refusal({"preset": "tiny", "lr": 0.2, "mesh": {"data": 4}}, {})
    assert "width: saved 8, given 64" in text and "depth: saved 1, given 4" in text, text
    # (a deployment's run is given the same as a dict)
    assert """; a flow's program_params {"preset": "tiny", "lr": 0.2})""" in text, text
    assert suggested == " (--program-param preset=tiny --program-param lr=0.2)", suggested
    # a field given now that the run was not given: at its saved value
    _, suggested = refusal({"preset": "tiny"}, {"lr": 0.3, "mesh": {"data": 2}})
    assert suggested == " (--program-param preset=tiny --program-param lr=0.1)", suggested
    # a step saved before the given fields were recorded: every field that differs
    _, suggested = refusal({"preset": "tiny"}, {}, lambda meta: meta.pop("given"))
    want = " (--program-param depth=1 --program-param preset=tiny --program-param width=8)"
    assert suggested == want, suggested
    # the preset's fields changed since the step (its width 9 then): the preset alone would not
    # resume it, with or without a given field that differs too
    for given_now in ({"preset": "tiny"}, {"lr": 0.3}):
        _, suggested = refusal({"preset": "tiny"}, given_now, lambda m: m["values"].update(width=9))
        assert "--program-param width=9" in suggested, suggested
    # strings the command would read back as JSON, and spaces: quoted for the shell
    _, suggested = refusal({"note": "12", "lr": 0.5}, {"note": "a b"})
    assert suggested == """ (--program-param lr=0.5 --program-param 'note="12"')""", suggested
    _, suggested = refusal({"note": "a b"}, {})
    assert suggested == " (--program-param 'note=a b')", suggested


def test_a_boolean_is_taken_by_the_fields_that_take_one():
    """The boolean refusal is for numbers (which pydantic would turn it into): a bool field, an
    optional one, a union with bool and an untyped one take it as it is."""
    from typing import Annotated, Any

    from pydantic import BaseModel, BeforeValidator, Field

    from prefect_jax.training.program_params import ProgramParamsError, validate_params

    def on_off(value):
        return {True: 1.0, False: 0.0}.get(value, value) if isinstance(value, bool) else value

    class Flags(BaseModel):
        bias: bool = False
        tied: bool | None = None
        either: int | bool = 0
        anything: Any = None
        count: int | None = None
        rate: Annotated[float, BeforeValidator(on_off)] = 0.5  # maps booleans itself
        share: Annotated[float, Field(ge=0)] = 0.5

    given = {"bias": True, "tied": False, "either": True, "anything": True, "rate": True}
    instance, recorded = validate_params(Flags, given, "p")
    assert (instance.bias, instance.tied, instance.either, instance.anything) == (
        True,
        False,
        True,
        True,
    )
    assert instance.rate == 1.0 and recorded.given == tuple(given)
    with pytest.raises(ProgramParamsError, match=r"count=True: count takes int \| None, not a"):
        validate_params(Flags, {"count": True}, "p")
    with pytest.raises(ProgramParamsError, match=r"share=False: share takes float, not a"):
        validate_params(Flags, {"share": False}, "p")


def test_a_hook_is_checked_as_it_will_be_called_decorated_or_partial():
    import functools

    from prefect_jax.training.program import check_called_with

    def needs_ctx(ctx, view):
        return view

    @functools.wraps(needs_ctx)  # (its signature reads as the wrapped one's: two arguments)
    def supplies_ctx(view):
        return needs_ctx(None, view)

    check_called_with(supplies_ctx, 1, "train hook 'm:f'", "fn(view)")
    check_called_with(functools.partial(needs_ctx, None), 1, "train hook 'm:f'", "fn(view)")
    check_called_with(lambda *views: None, 1, "train hook 'm:f'", "fn(view)")
    with pytest.raises(
        ProgramError,
        match=r"^train hook 'm:f' takes 2 required positional arguments \(at most 2\), and is "
        r"called with 1: define it as fn\(view\)$",
    ):
        check_called_with(needs_ctx, 1, "train hook 'm:f'", "fn(view)")


def test_the_roles_that_do_not_train_take_the_params_their_trainer_was_given():
    """What the evaluator and the exporter take from the newest step's record: the fields its
    trainer was given, under their own; not a field the engine filled (max_steps) nor an exempt
    one (a mesh: the role's machine may have fewer devices); nothing from a step that did not
    record which were given."""
    from prefect_jax.training.following import trainers_max_steps, trainers_program_params
    from prefect_jax.training.program_params import ProgramParams

    saved = ProgramParams(
        "P",
        {"width": 16, "lr": 0.1, "max_steps": 40, "mesh": "4x2", "depth": 2},
        filled=("max_steps",),
        exempt=("mesh",),
        given=("width", "lr", "mesh"),
    )
    meta = {"program_params": saved.as_meta(), "max_steps": 40}
    assert trainers_program_params(meta, None) == (
        {"width": 16, "lr": 0.1},
        {"width": 16, "lr": 0.1},
    )
    assert trainers_program_params(meta, {"lr": 0.2, "mesh": "8"}) == (
        {"width": 16, "lr": 0.2, "mesh": "8"},
        {"width": 16},
    )
    older = {"program_params": {**saved.as_meta(), "given": None}}
    assert trainers_program_params(older, None) == (None, {})
    assert trainers_program_params(None, {"lr": 0.2}) == ({"lr": 0.2}, {})
    assert trainers_max_steps(meta, 1000) == 40 and trainers_max_steps(older, 1000) == 1000
