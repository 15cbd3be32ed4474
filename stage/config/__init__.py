"""The stage's configuration: the typed model (stage.config.model, StageConfig), where values
come from and in which order (stage.config.sources), the shared field types
(stage.config.types), and the generated Helm schema and settings docs (stage.config.schema)."""
