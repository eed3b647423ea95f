"""The seed article's French keys and values, as the canonical English ones (DESIGN.md §4): the
seed's ``configuration_mcp.yaml`` loads unchanged."""

from __future__ import annotations

FRENCH_KEYS: dict[tuple[str, ...], dict[str, str]] = {
    (): {
        "parallelisation": "parallelism",
        "controleurs": "controllers",
        "optimisation": "optimization",
        "modele": "model",
        "donnees": "data",
        "entrainement": "training",
    },
    ("parallelism",): {
        "tensorielle": "tensor",
        "experts": "experts",
        "pipeline": "pipeline",
        "donnees": "data",
    },
    ("controllers",): {"calcul": "compute", "memoire": "memory"},
    ("controllers", "compute"): {"ordonnanceur": "scheduler", "decoupage_lot": "batch_splitting"},
    ("controllers", "memory"): {"dechargement": "offload"},
    ("controllers", "communication"): {"topologie": "topology"},
    ("optimization",): {
        "accumulation_gradient": "gradient_accumulation",
        "point_controle": "checkpoint",
    },
    ("optimization", "checkpoint"): {"intervalle": "interval", "strategie": "strategy"},
}

FRENCH_VALUES: dict[str, str] = {
    "renforcement": "reinforcement",
    "glouton": "greedy",
    "statique": "static",
    "dynamique": "dynamic",
    "fixe": "fixed",
    "conscient_topologie": "topology_aware",
    "defaut": "default",
    "aucun": "none",
    "aucune": "none",
    "hybride": "hybrid",
    "hierarchique": "hierarchical",
    "plat": "flat",
    "complete": "full",
    "complet": "full",
}
