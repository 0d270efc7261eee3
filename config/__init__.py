"""Configuration: pydantic models, the TOML loader, and the shipped example files."""

from pathlib import Path

from config.loader import ConfigError, config_from_mapping, load_config, reloaded
from config.models import (
    Accountant,
    AnalystConfig,
    AuthMethod,
    BackendConfig,
    ColumnBounds,
    Config,
    DefaultsConfig,
    NoiseKind,
    TableConfig,
)

CONFIG_DIR = Path(__file__).parent
DEMO_CONFIG = CONFIG_DIR / "demo.toml"
EXAMPLE_CONFIG = CONFIG_DIR / "example.toml"

__all__ = [
    "CONFIG_DIR",
    "DEMO_CONFIG",
    "EXAMPLE_CONFIG",
    "Accountant",
    "AnalystConfig",
    "AuthMethod",
    "BackendConfig",
    "ColumnBounds",
    "Config",
    "ConfigError",
    "DefaultsConfig",
    "NoiseKind",
    "TableConfig",
    "config_from_mapping",
    "load_config",
    "reloaded",
]
