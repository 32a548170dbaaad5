"""Starting and watching vLLM: profiles, launch plan, preflight, memory guard, watchdog, the server process, client."""
