"""Federated reinforcement learning (docs/rl.md; issue #18).

- horizontal FRL: PAvg (REINFORCE or PPO agents), personalized PAvg, QAvg (DQN or Double DQN)
  and local baselines on K agents with their own environment physics, run as one stacked
  tensor program (``horizontal``, ``policy_gradient``, ``ppo``, ``ppo_agents``, ``dqn``,
  ``stream``, ``aggregate``);
- vertical federated DQN (Zhuo et al. 2019) and the baselines of docs/rl.md (``vertical_dqn``,
  ``vertical_agents``);
- environments: a torch-batched CartPole equal to Gymnasium's step (``cartpole``) and any
  Gymnasium task through its vector API (``gym_vector``);
- tabular QAvg and its value-iteration oracle (``tabular``);
- the YAML contract (``config``) and the run family (``run.RLFamily``), which ``fedloom.run``
  picks for ``data.name: cartpole | acrobot`` and runs through the run shell
  (engine/shell.py).

This package's ``__init__`` imports nothing: the API imports ``fedloom.rl.config`` to recognise
an RL config without loading Gymnasium.
"""
