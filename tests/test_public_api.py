import dynabatch


def test_every_public_name_is_importable_and_documented():
    for name in dynabatch.__all__:
        obj = getattr(dynabatch, name)
        if callable(obj):
            assert obj.__doc__, name


def test_the_spec_signature_is_kept():
    import inspect

    params = inspect.signature(dynabatch.build_dynamic_batch_dataloader).parameters
    assert list(params)[:10] == [
        "texts", "tokenizer", "batch_size", "max_input_token_length", "threshold", "shuffle", "num_workers",
        "batch_start_range", "batch_end_range", "steps",
    ]
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults["threshold"] == 0.025 and defaults["num_workers"] == 4 and defaults["steps"] == 50
    assert defaults["batch_start_range"] == 1.0 and defaults["batch_end_range"] == 6.0
    assert defaults["shuffle"] is False
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
