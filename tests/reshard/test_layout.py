import pytest

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout

CONFIG = ModelConfig(
    num_layers=8, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128, padded_vocab_size=256, vocab_size=250
)


def test_even_and_virtual_stages():
    assert Layout(pp=2).stage_layers(8) == [range(0, 4), range(4, 8)]
    # Megatron interleaves virtual stages: chunk index = vstage * pp + pp_rank.
    assert Layout(pp=2, vpp=2).stage_layers(8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert Layout(pp=2, vpp=2).chunk_of_layer(8, 5) == (0, 1, 1)


def test_uneven_first_and_last_stage():
    assert Layout(pp=3, first_stage_layers=2, last_stage_layers=2).stage_layers(8) == [range(0, 2), range(2, 6), range(6, 8)]
    assert Layout(pp=2, first_stage_layers=3).stage_layers(8) == [range(0, 3), range(3, 8)]
    with pytest.raises(ReshardError, match="cannot be split"):
        Layout(pp=3, first_stage_layers=5, last_stage_layers=5).stage_layers(9)
    with pytest.raises(ReshardError, match="cannot be split"):
        Layout(pp=4, first_stage_layers=2, last_stage_layers=2).stage_layers(9)  # 5 layers over 2 middle stages


@pytest.mark.parametrize("layers, pp, first, last", [
    (4, 2, 3, None), (4, 2, None, 1), (4, 2, 2, 2), (8, 3, 2, 2), (8, 4, 2, None), (9, 4, None, 3), (9, 3, 3, None),
    (4, 2, 0, None), (4, 2, -1, None), (4, 2, None, 0), (4, 2, None, -3), (4, 3, 0, 0),  # an empty or negative stage
    (4, 4, 2, 2), (4, 3, 2, 2), (4, 2, 4, None), (8, 3, None, 8),  # empty middle stages
])
def test_stages_exist_exactly_when_megatron_core_says_they_do(layers, pp, first, last):
    """Megatron-Core's TransformerConfig is the oracle: a split it refuses is refused, one it builds is split (it lets
    a first stage of more layers than the model through, which reshard refuses too: see above)."""
    torch = pytest.importorskip("torch")
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                          pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=first,
                          num_layers_in_last_pipeline_stage=last)
        exists = True
    except ValueError:
        exists = False
    layout = Layout(pp=pp, first_stage_layers=first, last_stage_layers=last)
    if exists:
        stages = layout.stage_layers(layers)
        assert [len(s) for s in stages if len(s) == 0] == [] and stages[-1].stop == layers
    else:
        with pytest.raises(ReshardError, match="at least one layer"):
            layout.stage_layers(layers)


@pytest.mark.parametrize(
    "layout, message",
    [
        (Layout(tp=3), "attention heads"),
        (Layout(tp=8), "query groups"),
        (Layout(pp=3), "layers"),
        (Layout(ep=2), "mixture-of-experts"),
        (Layout(tp=0), "positive"),
        (Layout(tp=1, etp=2), "ETP=2 with TP=1"),  # more expert TP parts than TP rank files
        (Layout(tp=4, etp=3), "divisors of 4"),
    ],
)
def test_validate_names_the_constraint(layout, message):
    with pytest.raises(ReshardError, match=message):
        layout.validate(CONFIG)


def test_retarget_keeps_derived_settings_consistent():
    source = Layout(tp=2, pp=2, etp=2, first_stage_layers=3)
    target = source.retarget(tp=4, pp=4)
    assert target.tp == 4 and target.expert_tp == 4  # ETP followed TP at the source, so it follows it
    assert target.first_stage_layers is None
    assert Layout(tp=2, etp=1).retarget(tp=4).expert_tp == 1
