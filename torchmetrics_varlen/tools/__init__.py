"""Tooling (demo, benchmark, GPU check): never imported by the runtime package."""
