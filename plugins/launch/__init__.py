"""Launchers (torchrun, accelerate launch): the launcher plugin (checks before workers start,
worker environment, bootstrap) and the launch_settings plugin (a config's sidecar environment,
deepspeed_config_file relative to the YAML)."""
