"""Tests of mcore_rl.agent."""
