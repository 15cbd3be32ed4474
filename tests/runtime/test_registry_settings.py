"""The ``schema_registry:`` settings (basic auth, TLS): read from YAML and the environment, checked,
kept secret, and handed to every Schema Registry client the project makes."""

import pytest

from stage.client.registry import schema_registry_client
from stage.config.model import StageConfig, load_config
from stage.runtime.kafka.registry import build_codecs, registry_client

SECRET = "pw-7f3a9c"
ENV = {"ROLLOUT_REASSEMBLER_FRAMING": "confluent",
       "ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY_URL": "https://registry:8081",
       "ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO": f"stage:{SECRET}",
       "ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__SSL_CA_LOCATION": "/etc/sr/ca.crt"}


def test_settings_from_yaml_and_environment(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text("framing: confluent\nschema_registry_url: https://registry:8081\n"
                    "schema_registry:\n  ssl_certificate_location: /etc/sr/tls.crt\n"
                    "  ssl_key_location: /etc/sr/tls.key\n")
    cfg = load_config(path, ENV)
    assert cfg.schema_registry.client_properties() == {
        "basic.auth.user.info": f"stage:{SECRET}", "ssl.ca.location": "/etc/sr/ca.crt",
        "ssl.certificate.location": "/etc/sr/tls.crt", "ssl.key.location": "/etc/sr/tls.key"}
    assert load_config(None, {}).schema_registry.client_properties() == {}


def test_the_user_info_is_never_shown():
    cfg = load_config(None, ENV)
    for text in (repr(cfg), str(cfg), repr(cfg.schema_registry), str(cfg.model_dump()),
                 cfg.model_dump_json()):
        assert SECRET not in text
    bad = {**ENV, "ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO": f"no-colon-{SECRET}"}
    with pytest.raises(ValueError) as error:
        load_config(None, bad)
    assert "schema_registry.basic_auth_user_info" in str(error.value)
    assert "<user>:<password>" in str(error.value) and SECRET not in str(error.value)


@pytest.mark.parametrize("env, needle", [
    ({"ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__SSL_KEY_LOCATION": "/k.pem"},
     r"ssl_key_location needs ssl_certificate_location"),
    ({"ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY_URL": "http://u:p@registry:8081",
      "ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO": "stage:x"},
     r"schema_registry_url carries user info and so does schema_registry.basic_auth_user_info"),
    ({"ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__TOKEN": "x"},
     r"unknown setting; known: basic_auth_user_info, ssl_ca_location"),
])
def test_rules(env, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(None, env)


def _rest(client):
    return client._rest_client   # confluent-kafka's HTTP client: what each request will carry


def test_the_stage_and_the_operator_commands_hand_the_settings_to_their_client():
    cfg = StageConfig(framing="confluent", schema_registry_url="http://registry:8081",
                      schema_registry={"basic_auth_user_info": f"stage:{SECRET}"})
    rest = _rest(registry_client(cfg))
    assert rest.auth == ("stage", SECRET)
    assert rest.max_retries == 0 and rest.timeout == 10   # the resolver retries, not the client
    codecs = build_codecs(cfg)   # what `inspect` and `dead-letters` decode with
    assert {_rest(codec.registry).auth for codec in codecs.values()} == {("stage", SECRET)}
    assert registry_client(cfg.replace(framing="plain")) is None


def test_sdk_clients_take_the_registry_config():
    from stage.client import StagingProducer
    from stage.client.consuming import codec_for
    conf = {"basic.auth.user.info": f"stage:{SECRET}"}
    producer = StagingProducer("127.0.0.1:1", framing="confluent",
                               schema_registry_url="http://registry:8081", schema_registry_config=conf)
    assert {_rest(c.registry).auth for c in producer.codecs.values()} == {("stage", SECRET)}
    reader_codec = codec_for("CanonicalRow", "rows", "confluent", "http://registry:8081", schema_registry_config=conf)
    assert _rest(reader_codec.registry).auth == ("stage", SECRET)
    assert _rest(schema_registry_client("http://r:1", conf, max_retries=2)).max_retries == 2
    with pytest.raises(ValueError, match="needs schema_registry_url"):
        schema_registry_client("", conf)

