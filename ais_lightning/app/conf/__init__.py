"""Hydra configs of ais-train (a package so that Hydra finds them in an installed ais_lightning)."""
