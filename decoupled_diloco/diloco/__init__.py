"""Decoupled DiLoCo core: fragment plans, merge rules, outer optimizer, wire compression."""
