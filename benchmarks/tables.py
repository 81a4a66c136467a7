"""placeholder"""
def records_markdown(folder):
    return "No records yet."
