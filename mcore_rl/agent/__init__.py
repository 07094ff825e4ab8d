"""Multi-turn agentic rollouts with tools: tool-call parsing (parser.py), the tools (tools.py, sandbox.py) and the
rollout over the SGLang engine (rollout.py). See docs/agent.md."""
