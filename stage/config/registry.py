"""Schema Registry client settings (``schema_registry:``): HTTP basic auth and TLS, passed to every
confluent-kafka SchemaRegistryClient the stage and its operator commands make.

The user info is a secret: a pydantic SecretStr, so the configuration's repr, a configuration
error and the stage's logs show it masked. The Helm chart sets it from a Secret
(``schemaRegistry.basicAuth``), never from the ConfigMap.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator, model_validator

from stage.config.types import ConfigModel, conflict


class SchemaRegistrySettings(ConfigModel):
    basic_auth_user_info: SecretStr | None = Field(
        None, description="`<user>:<password>` for HTTP basic auth (confluent-kafka "
                          "`basic.auth.user.info`). A secret: shown masked, never logged; with the Helm "
                          "chart it comes from a Secret (`schemaRegistry.basicAuth`)")
    ssl_ca_location: str = Field(
        "", description="CA certificate file (PEM) or directory that verifies an `https://` registry; "
                        "empty: the system's CA bundle")
    ssl_certificate_location: str = Field(
        "", description="client certificate (PEM) for a registry that requires mutual TLS")
    ssl_key_location: str = Field(
        "", description="the client certificate's private key (PEM, unencrypted); needs "
                        "`ssl_certificate_location`")

    @field_validator("basic_auth_user_info")
    @classmethod
    def _user_and_password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        user, colon, _ = value.get_secret_value().partition(":")
        if not colon or not user:
            # the value itself is not repeated: it is a password
            raise ValueError("must be `<user>:<password>` (the value is not shown)")
        return value

    @model_validator(mode="after")
    def _key_needs_certificate(self) -> SchemaRegistrySettings:
        if self.ssl_key_location and not self.ssl_certificate_location:
            raise conflict("schema_registry.ssl_key_location needs ssl_certificate_location",
                           "ssl_key_location", "ssl_certificate_location")
        return self

    def client_properties(self) -> dict[str, str]:
        """The confluent-kafka SchemaRegistryClient properties these settings set."""
        props = {"ssl.ca.location": self.ssl_ca_location,
                 "ssl.certificate.location": self.ssl_certificate_location,
                 "ssl.key.location": self.ssl_key_location}
        if self.basic_auth_user_info is not None:
            props["basic.auth.user.info"] = self.basic_auth_user_info.get_secret_value()
        return {key: value for key, value in props.items() if value}
