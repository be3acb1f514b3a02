"""Operator tools against a running server: rollouts of compute models and spend reports."""
