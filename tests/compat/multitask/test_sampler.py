"""MemoryAwareBatchSampler: the multi-task system's call, metadata, budget, epochs, resume, ranks and bad input."""

import pytest

from dynabatch.compat.multitask import MemoryAwareBatchSampler, MemoryPredictor


class _Data:
    """A dataset with the multi-task system's get_sample_metadata (task and number of images, as in its docs)."""

    def __init__(self, n=60):
        self.samples = [{"subject_id": [i, i + 1] if i % 3 == 0 else i, "length": 8 + i % 24} for i in range(n)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]

    def get_sample_metadata(self, idx):
        sample = self.samples[idx]
        multi = isinstance(sample["subject_id"], list)
        return {"task_type": "T3" if multi else "T1", "num_images": 2 if multi else 1, "length": sample["length"]}


@pytest.fixture
def predictor():
    p = MemoryPredictor("cuda:0")  # a device name is only recorded: the peaks below are given in MB
    for rows in (1, 2, 4, 8, 16):
        for length in (8, 16, 32):
            p.record_actual_memory("T1", 100 + 4.0 * rows * length, batch_size=rows, seq_length=length)
            p.record_actual_memory("T3", 100 + 9.0 * rows * length, batch_size=rows, seq_length=length)
    return p


def test_the_seed_call_before_any_measurement_plans_every_index_by_batch_size_and_warns_once(predictor, caplog):
    # the multi-task system's call, with a measured predictor in the process that the sampler must not pick up by itself
    data = _Data()
    with caplog.at_level("WARNING", logger="dynabatch.compat.multitask.sampler"):
        sampler = MemoryAwareBatchSampler(dataset=data, batch_size=16, max_memory_mb=30000, shuffle=True,
                                          task_diversity_weight=0.5)
    assert sampler.predictor is None and not sampler.calibrated
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "memory is not calibrated yet (no predictor was given)" in warnings[0]
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    assert all(len(b) <= 16 for b in batches) and sum(len(b) == 16 for b in batches) >= len(data) // 16 - 2
    assert sampler.predicted_mb(batches[0]) is None


def test_seed_call_plans_under_budget_and_covers_every_index(predictor):
    data = _Data()
    sampler = MemoryAwareBatchSampler(dataset=data, batch_size=16, max_memory_mb=3000, shuffle=True,
                                      task_diversity_weight=0.5, predictor=predictor)
    assert sampler.predictor is predictor and sampler.calibrated
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    usable = 3000 * (1 - 0.10)
    for b in batches:
        assert len(b) <= 16
        tasks = [data.get_sample_metadata(i)["task_type"] for i in b]
        lengths = [data.get_sample_metadata(i)["length"] for i in b]
        assert predictor.predict_batch_memory(tasks, lengths=lengths) * 1000 <= usable + 1e-6  # GB -> MB
        assert sampler.predicted_mb(b) == pytest.approx(predictor.predict_batch_memory(tasks, lengths=lengths) * 1000)
    sampler.set_epoch(1)
    assert [list(b) for b in sampler] != batches  # a new order each epoch
    sized = MemoryAwareBatchSampler(data, 16, 3000, size_field="num_images", seed=1, predictor=predictor)
    assert set(sized.lengths.tolist()) == {1, 2}


def test_bad_input_names_argument_and_value(predictor):
    data = _Data(10)
    with pytest.raises(ValueError, match=r"max_memory_mb should be a positive number, but got max_memory_mb=0"):
        MemoryAwareBatchSampler(data, 4, 0)
    with pytest.raises(ValueError, match=r"max_memory_mb should be at least what one sample needs \(task 'T3' at "
                                         r"length 17 needs 253 MB within the margin\), but got max_memory_mb=200"):
        MemoryAwareBatchSampler(data, 4, 200, memory_margin=0.0, predictor=predictor)
    with pytest.raises(ValueError, match=r"memory_margin should be a number in \[0, 1\), but got memory_margin=1.0"):
        MemoryAwareBatchSampler(data, 4, 3000, memory_margin=1.0)
    bad = _Data(3)
    bad.get_sample_metadata = lambda idx: {"num_images": 1}
    with pytest.raises(ValueError, match=r"dataset.get_sample_metadata\(0\) should be a dict with a 'task_type' key, "
                                         r"but got dataset.get_sample_metadata\(0\)=\{'num_images': 1\}"):
        MemoryAwareBatchSampler(bad, 4, 3000)
    for size, error, rule in ((3.7, TypeError, "a non-negative integer size"), ("12", TypeError, "a non-negative"),
                              (-3, ValueError, "a non-negative integer")):  # never cut to 3, nor planned as negative
        bad.get_sample_metadata = lambda idx, size=size: {"task_type": "T1", "length": size}
        with pytest.raises(error, match=rf"dataset.get_sample_metadata\(0\)\['length'\] should be {rule}"):
            MemoryAwareBatchSampler(bad, 4, 3000)
    bad.get_sample_metadata = lambda idx: {"task_type": "T1", "num_images": 1.5}
    with pytest.raises(TypeError, match=r"dataset.get_sample_metadata\(0\)\['num_images'\] should be a non-negative"):
        MemoryAwareBatchSampler(bad, 4, 3000, size_field="num_images")
    with pytest.raises(TypeError, match=r"task_types should be a sequence of task types, one per sample, but got "
                                        r"task_types='T1' of type str"):
        MemoryAwareBatchSampler(None, 4, 3000, task_types="T1")  # not two tasks 'T' and '1'
    with pytest.raises(TypeError, match=r"is_training should be a bool, but got is_training='no'"):
        MemoryAwareBatchSampler(data, 4, 3000, is_training="no")  # not read as True
    unmeasured = MemoryAwareBatchSampler(None, 4, 3000, task_types=["T1", "T9"], lengths=[3, 4], predictor=predictor)
    assert not unmeasured.calibrated  # T9 has no measurement: batches of batch_size, and a warning says why
    with pytest.raises(ValueError, match=r"task_diversity_weight should be a number in \[0, 1\]"):
        MemoryAwareBatchSampler(data, 4, 3000, task_diversity_weight=-0.5)
