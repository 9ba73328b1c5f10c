"""Where the tests read their datasets (conftest.data_root): $NANORLVR_DATA first, then
../shared/data, then a copy fetched once from the hub into the user's cache; and a root that lacks a
file stops the session with a message naming it."""

import conftest
import pytest


def a_root(folder, missing=()):
    """A data root with every file conftest.DATA_FILES names (empty files) but `missing`."""
    for name in conftest.DATA_FILES:
        if name not in missing:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("")
    return folder


def test_the_data_root_is_the_variable_then_shared_then_the_hub_copy(tmp_path, monkeypatch):
    data_root = conftest.data_root.__wrapped__  # without the session's cache
    variable = a_root(tmp_path / "variable")
    shared = a_root(tmp_path / "shared")
    hub = a_root(tmp_path / "hub")
    fetched = []
    monkeypatch.setattr(conftest, "SHARED_DATA", shared)
    monkeypatch.setattr(conftest, "hub_cache", lambda: hub)
    monkeypatch.setattr(conftest, "write_hub_copy", lambda root: fetched.append(root))
    monkeypatch.setenv(conftest.DATA_VAR, str(variable))
    assert data_root() == variable
    monkeypatch.delenv(conftest.DATA_VAR)
    assert data_root() == shared
    monkeypatch.setattr(conftest, "SHARED_DATA", tmp_path / "no such folder")
    # the hub copy, complete: nothing fetched
    assert data_root() == hub and fetched == []
    # incomplete: fetched (here, a stand-in that writes nothing), then checked
    (hub / conftest.DATA_FILES[0]).unlink()
    with pytest.raises(pytest.exit.Exception, match=conftest.DATA_FILES[0]):
        data_root()
    assert fetched == [hub]


def test_a_root_that_lacks_a_file_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv(
        conftest.DATA_VAR, str(a_root(tmp_path, missing=["ifeval/input_data.jsonl"]))
    )
    with pytest.raises(pytest.exit.Exception, match="ifeval/input_data.jsonl") as stopped:
        conftest.data_root.__wrapped__()
    assert f"${conftest.DATA_VAR}" in str(stopped.value)
