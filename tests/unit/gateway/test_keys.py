"""The keys file: parsing, validation (never echoing a secret) and lookup by bearer secret."""

from decimal import Decimal

import pytest

from triton_pipelines.gateway.keys import (KEYS_FILE_ENV, KeyRing, KeysFileError, bearer_secret, key_id,
                                       keys_from_environment, period_seconds)

SECRET_A = "sk-team-a-0123456789abcdef"
SECRET_B = "sk-team-b-0123456789abcdef"


def ring(*entries):
    return KeyRing.from_document({"keys": list(entries)})


def test_full_entry_parses_and_looks_up_by_secret():
    keys = ring({"key": SECRET_A, "name": "team-a", "max_budget_usd": 0.005, "budget_period": "1d",
                 "soft_budget_usd": "0.004", "rpm": 60, "tpm": 1000, "models": ["gpt-4.1"]},
                {"key": SECRET_B, "name": "team-b"})
    a = keys.lookup(SECRET_A)
    assert a.name == "team-a" and a.key_id == key_id(SECRET_A)
    assert a.max_budget_usd == Decimal("0.005") and a.soft_budget_usd == Decimal("0.004")
    assert a.budget_period_s == 86400 and a.rpm == 60 and a.tpm == 1000
    assert a.allows_model("gpt-4.1") and not a.allows_model("claude-sonnet-4.5")
    b = keys.lookup(SECRET_B)
    assert b.name == "team-b" and b.max_budget_usd is None and b.allows_model("anything")
    assert keys.lookup("sk-unknown-0123456789") is None and keys.lookup("") is None
    assert keys.by_id(a.key_id) is a and len(keys) == 2


def test_secrets_never_appear_in_repr_or_errors():
    keys = ring({"key": SECRET_A, "name": "team-a"})
    assert SECRET_A not in repr(keys) and SECRET_A not in repr(keys.lookup(SECRET_A))
    for bad in ({"key": SECRET_A, "name": "team-a", "rpm": 0},
                {"key": SECRET_A, "name": "team-a", "colour": "red"},
                {"key": SECRET_A + " x", "name": "team-a"}):
        with pytest.raises(KeysFileError) as error:
            ring(bad)
        assert SECRET_A not in str(error.value) and "team-a" in str(error.value)


@pytest.mark.parametrize("entry, words", [
    ({"key": "short", "name": "t"}, "`key` must be"),
    ({"key": SECRET_A, "name": "bad name"}, "`name` must be"),
    ({"key": SECRET_A, "name": "t", "max_budget_usd": -1}, "max_budget_usd"),
    ({"key": SECRET_A, "name": "t", "max_budget_usd": "lots"}, "max_budget_usd"),
    ({"key": SECRET_A, "name": "t", "max_budget_usd": 1, "budget_period": "weekly"}, "budget_period"),
    ({"key": SECRET_A, "name": "t", "budget_period": "1d"}, "needs max_budget_usd"),
    ({"key": SECRET_A, "name": "t", "tpm": True}, "tpm"),
    ({"key": SECRET_A, "name": "t", "models": []}, "models"),
])
def test_malformed_entries_are_named(entry, words):
    with pytest.raises(KeysFileError, match=words):
        ring(entry)


def test_duplicates_and_shape():
    with pytest.raises(KeysFileError, match="repeats the secret"):
        ring({"key": SECRET_A, "name": "a"}, {"key": SECRET_A, "name": "b"})
    with pytest.raises(KeysFileError, match="used twice"):
        ring({"key": SECRET_A, "name": "a"}, {"key": SECRET_B, "name": "a"})
    for document in (None, [], {"keys": []}, {"keys": {}}, {"keys": [], "extra": 1}):
        with pytest.raises(KeysFileError):
            KeyRing.from_document(document)


def test_periods():
    assert period_seconds("1h") == 3600 and period_seconds("30d") == 30 * 86400 and period_seconds("90s") == 90
    for bad in ("0d", "1w", "d", "1.5h", ""):
        with pytest.raises(ValueError):
            period_seconds(bad)


def test_bearer_header():
    assert bearer_secret(f"Bearer {SECRET_A}") == SECRET_A
    assert bearer_secret(f"bearer   {SECRET_A} ") == SECRET_A
    for bad in (None, "", "Bearer", "Bearer ", f"Basic {SECRET_A}", SECRET_A):
        assert bearer_secret(bad) is None


def test_environment(tmp_path):
    assert keys_from_environment({}) is None and keys_from_environment({KEYS_FILE_ENV: " "}) is None
    with pytest.raises(KeysFileError, match="no such file"):
        keys_from_environment({KEYS_FILE_ENV: str(tmp_path / "missing.yaml")})
    path = tmp_path / "keys.yaml"
    path.write_text(f'keys:\n  - key: "{SECRET_A}"\n    name: team-a\n    rpm: 10\n')
    assert keys_from_environment({KEYS_FILE_ENV: str(path)}).lookup(SECRET_A).rpm == 10
    path.write_text(f'keys:\n  - key: "{SECRET_A}\n    name: [\n')
    with pytest.raises(KeysFileError) as error:
        keys_from_environment({KEYS_FILE_ENV: str(path)})
    assert SECRET_A not in str(error.value)


def test_a_secret_that_is_not_printable_ascii_is_no_key():
    """Header bytes decoded as latin-1 or surrogates (non-UTF-8 in Authorization) are no key, on
    every path that looks one up (the screen and /v1), without an encoding error."""
    ring = KeyRing.from_document({"keys": [{"key": "sk-" + "a" * 20, "name": "team-a"}]})
    for secret in ("sk-\udcff" + "a" * 20, "sk-\xff" + "a" * 20, "sk-\x00" + "a" * 20):
        assert ring.lookup(secret) is None
    assert ring.lookup("sk-" + "a" * 20).name == "team-a"
