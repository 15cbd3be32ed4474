"""The Helm values schema's `config` and docs/configuration.md's settings tables are generated
from StageConfig: the committed files equal the generated ones, and the schema accepts and
refuses what the stage's own loader accepts and refuses."""

import json

import jsonschema
import pytest
import yaml

from stage.config import schema as config_schema
from stage.config.model import StageConfig, load_config

# JSON-schema (draft-07) keywords the generated schema may use: a pydantic-only one ("ge") would
# be ignored by helm and let a bad value through.
KEYWORDS = {"type", "properties", "additionalProperties", "required", "description", "enum", "const",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
            "pattern", "anyOf", "if", "then"}


def test_committed_files_are_the_generated_ones():
    assert config_schema.HELM_SCHEMA.read_text() == config_schema.helm_schema_text(), \
        "values.schema.json is stale: run `python -m stage.config.schema`"
    assert config_schema.DOCS.read_text() == config_schema.docs_text(), \
        "docs/configuration.md is stale: run `python -m stage.config.schema`"
    assert config_schema.main(["--check"]) == 0


def _keywords(node, out: set) -> set:
    if isinstance(node, dict):
        for key, value in node.items():
            if key != "properties":
                out.add(key)
            for child in (value.values() if key == "properties" else [value]):
                _keywords(child, out)
    elif isinstance(node, list):
        for item in node:
            _keywords(item, out)
    return out


def test_schema_is_draft7_and_lists_every_setting_but_the_charts():
    schema = config_schema.helm_config_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert _keywords(schema, set()) <= KEYWORDS
    assert set(schema["properties"]) == set(StageConfig.model_fields) - set(config_schema.SET_BY_CHART)
    assert schema["additionalProperties"] is False
    for section in ("topics", "finalize"):
        nested = schema["properties"][section]
        assert nested["additionalProperties"] is False
        assert set(nested["properties"]) == set(StageConfig.model_fields[section].annotation.model_fields)


GOOD = [{"bootstrap_servers": "b:9092"},
        {"bootstrap_servers": "b", "finalize": {"device": "cuda:1", "max_seq_len": None,
                                                "route_plan_schema_version": 2}},
        {"bootstrap_servers": "b", "kafka": {"linger.ms": 5, "enable.ssl.certificate.verification": False}},
        {"bootstrap_servers": "b", "framing": "confluent", "schema_registry_url": "http://sr:8081"}]
BAD = [{"bootstrap_servers": "b", "poll_timeout_ms": -1},
       {"bootstrap_servers": "b", "poll_timeout_ms": 5000},
       {"bootstrap_servers": "b", "revoke_budget_ms": -10},
       {"bootstrap_servers": "b", "metrics_port_typo": 1},
       {"bootstrap_servers": "b", "transaction_timeout_ms": 900001},
       {"bootstrap_servers": "b", "resume_fraction": 1.0},
       {"bootstrap_servers": "b", "finalize": {"device": "tpu"}},
       {"bootstrap_servers": "b", "finalize": {"route_plan_schema_version": 9}},
       {"bootstrap_servers": "b", "finalize": {"max_seq_len": 0}},
       {"bootstrap_servers": "b", "topics": {"receipts": "no spaces"}},
       {"bootstrap_servers": "b", "kafka": {"linger.ms": None}},
       {"bootstrap_servers": "b", "framing": "confluent"},
       {"bootstrap_servers": ""}]


@pytest.mark.parametrize("values", GOOD, ids=json.dumps)
def test_schema_and_loader_accept_the_same_values(tmp_path, values):
    assert list(jsonschema.Draft7Validator(config_schema.helm_config_schema()).iter_errors(values)) == []
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(values))
    load_config(tmp_path / "c.yaml", {})


@pytest.mark.parametrize("values", BAD, ids=json.dumps)
def test_schema_and_loader_refuse_the_same_values(tmp_path, values):
    assert list(jsonschema.Draft7Validator(config_schema.helm_config_schema()).iter_errors(values))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(values))
    with pytest.raises(ValueError):
        load_config(tmp_path / "c.yaml", {})


def test_check_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_schema.DOCS.read_text().replace("| `group_timeout_ms` |", "| `group_timeout` |"))
    monkeypatch.setattr(config_schema, "DOCS", stale)
    monkeypatch.setattr(config_schema, "ROOT", tmp_path)
    assert config_schema.main(["--check"]) == 1
    assert "out of date: configuration.md" in capsys.readouterr().out
    assert config_schema.main([]) == 0 and stale.read_text() == config_schema.docs_text()
