"""The look shared by moeplace's HTML pages (the analysis report and the compare report): one stylesheet."""

BASE_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 32px}
header h1{margin:0;font-size:22px;font-weight:600}
header p{margin:4px 0 0;color:#b9c1d0;font-size:13px}
.badge{background:#d9480f;color:#fff;border-radius:4px;padding:2px 8px;margin-left:10px;font-size:14px}
main{max-width:1250px;margin:0 auto;padding:16px 32px 48px}
section{background:#fff;border:1px solid #e1e4ea;border-radius:8px;padding:14px 20px;margin:16px 0}
h2{font-size:17px;margin:2px 0 10px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
th,td{border-bottom:1px solid #e8eaef;padding:3px 9px;text-align:right}
th{background:#f0f2f5;font-weight:600}
td:first-child,th:first-child{text-align:left}
.na{color:#8a93a3;font-style:italic}
.note{font-size:13px;color:#3d4555}
"""  # page frame: header, badge, main column, sections, headings, tables, notes
