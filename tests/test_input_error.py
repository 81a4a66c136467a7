"""InputError: the caller's mistake with its field and code as data; the message is the field
and the detail as one line."""

from pathlib import Path

from glassformer.errors import InputError


def test_the_field_and_code_are_data_and_the_message_names_the_field():
    error = InputError("temperature", "must be >= 0, got -1")
    assert isinstance(error, ValueError)
    assert (error.field, error.code, error.detail) == ("temperature", "invalid_value", "must be >= 0, got -1")
    assert str(error) == "temperature: must be >= 0, got -1"
    assert InputError("stop", "empty", "invalid_stop").code == "invalid_stop"


def test_no_field_leaves_the_message_alone_and_a_path_is_kept_as_text():
    assert (str(InputError(None, "no model here")), InputError(None, "x").field) == ("no model here", None)
    error = InputError(Path("/runs/a/config.json"), "lacks the model")
    assert error.field == "/runs/a/config.json" and str(error) == "/runs/a/config.json: lacks the model"
