"""Deployment helpers: see ``prefect.yaml`` at the repository root for deployable examples.

Work-pool job templates for GPU/TPU pools and automations arrive with the trainer/evaluator
deployments (separate roles on separate pools).
"""
