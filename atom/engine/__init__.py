"""The engine proper: model-agnostic and tier-agnostic (see ARCHITECTURE.md section 3)."""
