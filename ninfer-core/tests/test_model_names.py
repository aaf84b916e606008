"""What a command's model argument may be: a file, the embedded model, or a Hugging Face id that a plugin's
``ninfer_resolve_model`` turns into an artifact (ninfer-convert fetches and converts it; tests/test_hub_models.py).
Without such a plugin an id is answered with what to install; a missing relative path is never taken for an id."""

import pytest

import ninfer
from ninfer.plugins import make_plugin_host


@pytest.mark.parametrize("arg, is_id", [
    ("Qwen/Qwen3.5-0.8B", True), ("Qwen/Qwen3.5-0.8B@main", True), ("org/name@v1.0", True),
    ("org/name@0123abc", True), ("out/model.ninfer", False), ("./org/name", False), ("/abs/path", False),
    ("a/b/c", False), ("name", False), ("org/..", False), ("org/name@", False), ("org/na me", False),
])
def test_which_arguments_are_model_ids(arg, is_id):
    assert ninfer.looks_like_model_id(arg) is is_id


def test_an_id_without_a_plugin_that_resolves_it_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bare = make_plugin_host(autoload=False)
    with pytest.raises(ValueError, match=r"^no file Qwen/Qwen3\.5-0\.8B here, and using Hugging Face model ids needs "
                                         r"ninfer-convert: pip install ninfer-convert"):
        ninfer.resolve_model_path("Qwen/Qwen3.5-0.8B", host=bare)
    with pytest.raises(ValueError, match="^model file not found: out/model.ninfer$"):
        ninfer.resolve_model_path("out/model.ninfer", host=bare)
    (tmp_path / "Qwen").mkdir()
    (tmp_path / "Qwen" / "Qwen3.5-0.8B").write_bytes(b"x")  # an existing file of that name is taken as given
    assert ninfer.resolve_model_path("Qwen/Qwen3.5-0.8B", host=bare) == "Qwen/Qwen3.5-0.8B"
