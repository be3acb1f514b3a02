"""Assembles ``model_repository/`` for a target from one description per model.

``python -m repo_builder --target embedded|gpu`` (the Makefile's ``make repository``).
"""
