"""onnx_runner.InputCache: what the embedded compute models keep between a BLS caller's calls."""

import numpy as np
import pytest

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.onnx_runner import InputCache, parse_rows


def arrays(rows: int, offset: float = 0.0) -> dict[str, np.ndarray]:
    return {"k": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + offset,
            "v": -np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) - offset}


def test_stores_a_copy_and_returns_it_by_key():
    cache, given = InputCache(["k", "v"]), arrays(4)
    stored = cache.resolve("slot", given)
    given["k"][:] = 99  # the caller's buffer (shared memory) is reused after the call
    again = cache.resolve("slot", {})
    np.testing.assert_array_equal(again["k"], arrays(4)["k"])
    assert again["k"] is stored["k"]


def test_rows_are_original_row_numbers_and_shrink_for_good():
    cache = InputCache(["k", "v"])
    cache.resolve("slot", arrays(5))
    cut = cache.resolve("slot", {}, rows=[0, 2, 4])
    np.testing.assert_array_equal(cut["k"], arrays(5)["k"][[0, 2, 4]])
    assert cut["k"].flags.c_contiguous
    # later calls name original rows again; the same set reuses the gathered copy
    assert cache.resolve("slot", {}, rows=[0, 2, 4])["k"] is cut["k"]
    np.testing.assert_array_equal(cache.resolve("slot", {}, rows=[4])["v"], arrays(5)["v"][[4]])
    with pytest.raises(InputError, match="not a subset"):
        cache.resolve("slot", {}, rows=[2])  # left earlier


def test_a_keys_next_batch_is_copied_into_its_buffers_not_new_memory():
    """A fresh allocation of the Whisper decoder's cross K/V (37 MB per window) is pages the kernel
    must fault in; the key's next batch refills the buffers it already holds when they have room."""
    cache = InputCache(["k", "v"])
    first = cache.resolve("slot", arrays(4))
    smaller = cache.resolve("slot", arrays(3, offset=5))
    assert np.shares_memory(smaller["k"], first["k"]) and np.shares_memory(smaller["v"], first["v"])
    np.testing.assert_array_equal(smaller["k"], arrays(3, offset=5)["k"])
    np.testing.assert_array_equal(cache.resolve("slot", {})["v"], arrays(3, offset=5)["v"])
    assert smaller["k"].flags.c_contiguous
    larger = cache.resolve("slot", arrays(6, offset=9))  # no room: a buffer of its size
    assert not np.shares_memory(larger["k"], first["k"])
    np.testing.assert_array_equal(larger["k"], arrays(6, offset=9)["k"])
    other_shape = cache.resolve("slot", {"k": np.ones((2, 4), np.float32), "v": np.ones((2, 2), np.float32)})
    assert other_shape["k"].shape == (2, 4)  # another row shape never lands in the old buffer


def test_finished_rows_leave_in_place_and_the_running_ones_keep_their_values():
    cache = InputCache(["k", "v"])
    full = cache.resolve("slot", arrays(6))
    for rows in ([0, 2, 3, 5], [2, 5], [5]):
        cut = cache.resolve("slot", {}, rows=rows)
        np.testing.assert_array_equal(cut["k"], arrays(6)["k"][rows])
        np.testing.assert_array_equal(cut["v"], arrays(6)["v"][rows])
        assert np.shares_memory(cut["k"], full["k"]) and cut["k"].flags.c_contiguous


@pytest.mark.parametrize("rows", [[], [1, 0], [0, 0], [7]])
def test_bad_rows_are_refused(rows):
    cache = InputCache(["k", "v"])
    cache.resolve("slot", arrays(3))
    with pytest.raises(InputError, match="rows"):
        cache.resolve("slot", {}, rows=rows)


def test_storing_under_a_key_replaces_that_slot_only():
    cache = InputCache(["k", "v"])
    cache.resolve("a", arrays(2))
    cache.resolve("b", arrays(3))
    cache.resolve("a", arrays(1, offset=10))
    assert len(cache) == 2
    np.testing.assert_array_equal(cache.resolve("a", {})["k"], arrays(1, offset=10)["k"])
    assert len(cache.resolve("b", {})["k"]) == 3


def test_least_recently_used_key_leaves_first():
    cache = InputCache(["k", "v"], max_entries=2)
    cache.resolve("a", arrays(1))
    cache.resolve("b", arrays(1))
    cache.resolve("a", {})  # a is now the most recently used
    cache.resolve("c", arrays(1))
    assert len(cache) == 2
    cache.resolve("a", {})
    with pytest.raises(InputError, match="'b' is not cached"):
        cache.resolve("b", {})


def test_partial_inputs_and_unknown_keys_are_refused():
    cache = InputCache(["k", "v"])
    with pytest.raises(InputError, match="missing \\['v'\\]"):
        cache.resolve("slot", {"k": arrays(1)["k"]})
    with pytest.raises(InputError, match="'other' is not cached"):
        cache.resolve("other", {})


def test_parse_rows():
    assert parse_rows("0, 2,5") == [0, 2, 5]
    with pytest.raises(InputError, match="comma-separated integers"):
        parse_rows("0,x")


def test_a_resend_names_the_callers_rows():
    """A caller that sends the inputs again mid-batch names the rows they are (its window ids)."""
    cache = InputCache(["k", "v"])
    again = arrays(5)
    cache.resolve("slot", {n: a[[1, 3]] for n, a in again.items()}, rows=[1, 3])
    np.testing.assert_array_equal(cache.resolve("slot", {}, rows=[3])["k"], again["k"][[3]])
    with pytest.raises(InputError, match="2 rows named for 3 rows sent"):
        cache.resolve("slot", arrays(3), rows=[0, 1])


def test_no_entries_means_every_later_call_misses():
    cache = InputCache(["k", "v"], max_entries=0)
    assert cache.resolve("slot", arrays(2))["k"].shape == (2, 3)  # this call still gets them
    with pytest.raises(InputError, match="is not cached here"):
        cache.resolve("slot", {})


def test_execution_providers_are_chosen_in_order_or_refused_clearly(tmp_path):
    from triton_pipelines.pipelines.onnx_runner import providers_for

    gpu_build = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    chosen = providers_for(["tensorrt", "cuda", "cpu"], gpu_build, tmp_path)
    assert [name for name, _ in chosen] == gpu_build
    assert chosen[0][1]["trt_engine_cache_path"] == str(tmp_path) and chosen[0][1]["trt_fp16_enable"]
    with pytest.raises(ValueError, match="install onnxruntime-gpu"):  # no silent CPU fallback
        providers_for(["cuda", "cpu"], ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="choose among"):
        providers_for(["rocm"], gpu_build)


def test_the_builder_flag_puts_the_providers_in_every_embedded_compute_config():
    from repo_builder.compute import ComputeModel, TensorSpec

    model = ComputeModel("m", (TensorSpec("x", "TYPE_FP32", (4,)),), (TensorSpec("y", "TYPE_FP32", (4,)),), 8,
                         export_onnx=lambda path: None)
    assert "execution_providers" not in model.config("embedded").parameters  # cpu: the default
    gpu = model.config("embedded", "tensorrt,cuda,cpu")
    assert gpu.parameters["execution_providers"].string_value == "tensorrt,cuda,cpu"
    assert "execution_providers" not in model.config("gpu", "tensorrt,cuda,cpu").parameters


# --- state pairs: an input fed from the previous keyed call's output (the decoder's self K/V) -----

STATES = {"past": "present"}


def state(rows: int, length: int, offset: float = 0.0) -> np.ndarray:
    return np.arange(rows * length, dtype=np.float32).reshape(rows, length) + offset


def test_state_is_stored_after_a_run_and_fed_to_the_next_call():
    cache = InputCache(["k", "v"], states=STATES)
    first = cache.resolve("slot", {**arrays(3), "past": state(3, 0)})
    assert first["past"].shape == (3, 0)
    output = state(3, 1)
    cache.store_state("slot", {"present": output, "logits": np.zeros(3)})
    second = cache.resolve("slot", {})
    assert second["past"] is output  # the run's own output array, no copy
    np.testing.assert_array_equal(second["k"], arrays(3)["k"])
    cache.store_state("slot", {"present": state(3, 2)})
    assert cache.resolve("slot", {})["past"].shape == (3, 2)


def test_state_is_cut_to_the_calls_rows_and_stored_with_them():
    cache = InputCache(["k", "v"], states=STATES)
    cache.resolve("slot", {**arrays(4), "past": state(4, 0)})
    cache.store_state("slot", {"present": state(4, 2)})
    cut = cache.resolve("slot", {}, rows=[1, 3])
    np.testing.assert_array_equal(cut["past"], state(4, 2)[[1, 3]])
    np.testing.assert_array_equal(cut["k"], arrays(4)["k"][[1, 3]])
    cache.store_state("slot", {"present": state(2, 3, offset=100)})  # the run had rows 1 and 3
    again = cache.resolve("slot", {}, rows=[3])
    np.testing.assert_array_equal(again["past"], state(2, 3, offset=100)[[1]])
    cache.store_state("slot", {"present": state(1, 4)})
    with pytest.raises(InputError, match="not a subset"):
        cache.resolve("slot", {}, rows=[1])  # left earlier


def test_a_state_sent_explicitly_is_used_and_replaces_the_stored_one():
    cache = InputCache(["k", "v"], states=STATES)
    cache.resolve("slot", {**arrays(2), "past": state(2, 0)})
    cache.store_state("slot", {"present": state(2, 1)})
    explicit = state(2, 5, offset=7)
    assert cache.resolve("slot", {"past": explicit})["past"] is explicit
    cache.store_state("slot", {"present": state(2, 6)})
    assert cache.resolve("slot", {})["past"].shape == (2, 6)


def test_a_state_taken_and_not_stored_again_is_not_cached():
    """A failed run stores no output: the caller's next call is answered NOT_CACHED (and starts again)."""
    cache = InputCache(["k", "v"], states=STATES)
    cache.resolve("slot", {**arrays(2), "past": state(2, 0)})
    with pytest.raises(InputError, match="its state is not cached here"):
        cache.resolve("slot", {})  # the first run stored nothing
    cache.resolve("slot", {**arrays(2), "past": state(2, 0)}, rows=[4, 6])  # the caller resends
    cache.store_state("slot", {"present": state(2, 1)})
    assert cache.resolve("slot", {}, rows=[6])["past"].shape == (1, 1)
    with pytest.raises(InputError, match="send \\['past'\\] with the cached inputs"):
        cache.resolve("slot", arrays(2))


def test_state_leaves_with_its_key():
    cache = InputCache(["k", "v"], max_entries=1, states=STATES)
    cache.resolve("a", {**arrays(1), "past": state(1, 0)})
    cache.resolve("b", {**arrays(1), "past": state(1, 0)})
    cache.store_state("a", {"present": state(1, 1)})  # a has left: nothing is stored
    assert len(cache) == 1
    with pytest.raises(InputError, match="'a' is not cached here"):
        cache.resolve("a", {})


def test_a_model_with_state_only():
    cache = InputCache([], states=STATES)
    assert cache.resolve("slot", {"past": state(2, 0)})["past"].shape == (2, 0)
    cache.store_state("slot", {"present": state(2, 1)})
    np.testing.assert_array_equal(cache.resolve("slot", {}, rows=[1])["past"], state(2, 1)[[1]])
    with pytest.raises(InputError, match="'other': its state is not cached"):
        cache.resolve("other", {})


def test_parse_state_pairs():
    from triton_pipelines.pipelines.onnx_runner import parse_state_pairs

    assert parse_state_pairs("past_self_kv=present_self_kv") == {"past_self_kv": "present_self_kv"}
    assert parse_state_pairs("") == {}
    with pytest.raises(ValueError, match="input=output"):
        parse_state_pairs("past_self_kv")
