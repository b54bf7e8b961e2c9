from edge_agent.cli import main_entry

main_entry()
