import attrs


@attrs.frozen
class ExampleConfig:
    hidden_size: int = attrs.field(validator=attrs.validators.gt(0))
    num_hidden_layers: int = attrs.field(validator=attrs.validators.gt(0))


def parse_config(raw: dict) -> ExampleConfig:
    return ExampleConfig(hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"])
