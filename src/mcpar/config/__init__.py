"""The job configuration (DESIGN.md §4), one module per job:

- ``schema.py``: the typed sections and ``JobConfig`` (``model.py``: the model section and the
  published shapes);
- ``loading.py``: YAML files and ``--set`` overrides into a validated config, user errors;
- ``aliases.py``: the seed article's French keys and values;
- ``yaml_safe.py``: YAML parsing with bounds on size, depth and aliases;
- ``reference.py``: ``docs/config.md``, generated from the schema.
"""

from mcpar.config.aliases import FRENCH_KEYS, FRENCH_VALUES
from mcpar.config.loading import (
    DEFAULT_NPROC,
    apply_overrides,
    default_raw_config,
    load_config,
    parse_config,
    to_yaml,
)
from mcpar.config.model import ModelConfig
from mcpar.config.schema import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_DEGREE,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    CheckpointConfig,
    ClusterConfig,
    CommunicationControllerConfig,
    ComputeControllerConfig,
    ControllersConfig,
    DataConfig,
    ElasticConfig,
    JobConfig,
    MemoryControllerConfig,
    OptimizationConfig,
    ParallelismConfig,
    ProfileConfig,
    TrainingConfig,
    WandbConfig,
)
from mcpar.config.yaml_safe import (
    MAX_CONFIG_BYTES,
    MAX_YAML_ALIASES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    load_yaml,
)

__all__ = [
    "DEFAULT_NPROC", "FRENCH_KEYS", "FRENCH_VALUES", "MAX_BATCH", "MAX_CONFIG_BYTES", "MAX_COUNT",
    "MAX_DEGREE", "MAX_GLOBAL_BATCH", "MAX_LAYERS", "MAX_SEED", "MAX_STEPS", "MAX_TIMEOUT_S",
    "MAX_YAML_ALIASES", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "CheckpointConfig", "ClusterConfig",
    "CommunicationControllerConfig", "ComputeControllerConfig", "ControllersConfig",
    "DataConfig", "ElasticConfig", "JobConfig", "MemoryControllerConfig", "ModelConfig",
    "OptimizationConfig", "ParallelismConfig", "ProfileConfig", "TrainingConfig", "WandbConfig",
    "apply_overrides",
    "default_raw_config", "load_config", "load_yaml", "parse_config", "to_yaml",
]
